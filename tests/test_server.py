"""`eaglet serve` on a tiny model, through a live uvicorn server on 127.0.0.1 and the real `openai`
client: chat and completion, streamed and not, equal to Generator's greedy output (plain and
speculative, alone and batched); a load test (200 requests at concurrency 32, 0 failures, the KV
cache empty afterwards, memory flat over a second round); 50 clients that drop mid-stream; bad
requests answered 4xx in the OpenAI error shape while /health stays 200; a full queue (429); an
internal failure that fails only its own request; a dead engine (503); the CLI end to end.
The speculation policy is tested in test_server_policy.py."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import nullcontext

import httpx
import openai
import pytest

from eaglet.cli import main
from eaglet.generate import Generator
from eaglet.server import batcher as batcher_mod
from eaglet.server import engine as engine_mod

from .serving import (
    PROMPTS,
    LiveServer,
    free_port,
    gate_steps,
    kv_empty,
    reference,
    rss_mb,
    speculator,
    wait_for,
)

# ---- the OpenAI client --------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["plain", "ngram", "eagle3", "eagle3-trips"])
def test_greedy_through_the_server_equals_generator(tiny, drafter_dir, plain, kind):
    """Also with speculation steps 3 a host round trip (--spec-multi-step 3)."""
    sp = speculator(tiny, drafter_dir, kind.removesuffix("-trips"))
    live = nullcontext(plain) if kind == "plain" else LiveServer(
        Generator(tiny.model, tiny.tokenizer, sp), max_batch=4, spec_multi_step=3 if "trips" in kind else 1)
    with live as srv:
        c = srv.client()
        for prompt in PROMPTS[:3]:
            want = reference(tiny, sp, prompt, 24, chat=True)
            r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=24,
                                          temperature=0)
            assert r.choices[0].message.content == want and r.object == "chat.completion"
            u = r.usage
            assert u.prompt_tokens + u.completion_tokens == u.total_tokens and u.completion_tokens >= 1
            if sp is None:
                assert u.accept_length is None
            else:  # τ and the counters it comes from
                s = u.spec_decode
                assert s["num_drafts"] >= 1
                assert u.accept_length == pytest.approx(1 + s["num_accepted_tokens"] / s["num_drafts"])
            chunks = list(c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                                    max_tokens=24, temperature=0, stream=True,
                                                    stream_options={"include_usage": True}))
            assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
            assert chunks[0].choices[0].delta.role == "assistant"
            assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == r.choices[0].finish_reason
            assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == u.completion_tokens

            want = reference(tiny, sp, prompt, 16, chat=False)
            r = c.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0)
            assert r.choices[0].text == want and r.usage.completion_tokens >= 1
            streamed = c.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0, stream=True)
            assert "".join(ch.choices[0].text for ch in streamed) == want
        if sp is not None:
            m = srv.metrics()
            assert m["eaglet:spec_decode_num_drafts_total"] >= 1
            assert m["eaglet:spec_decode_num_draft_tokens_total"] >= m["eaglet:spec_decode_num_accepted_tokens_total"]
            per_pos = sum(v for k, v in m.items()
                          if k.startswith("eaglet:spec_decode_num_accepted_tokens_per_pos_total"))
            assert per_pos == m["eaglet:spec_decode_num_accepted_tokens_total"]


def test_stop_strings_token_ids_and_models(tiny, plain):
    c = plain.client()
    full = reference(tiny, None, PROMPTS[0], 24, chat=False)
    stop = full[5:7]  # cuts the text before its first occurrence
    r = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].text == reference(tiny, None, PROMPTS[0], 24, chat=False, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].text
    ids = tiny.tokenizer.encode(PROMPTS[0])
    r = c.completions.create(model="tiny", prompt=ids, max_tokens=24, temperature=0)
    assert r.choices[0].text == full and r.usage.prompt_tokens == len(ids)
    [card] = c.models.list().data
    assert card.id == "tiny" and card.max_model_len == tiny.config.max_position


def test_sampled_and_greedy_requests_mix(tiny, plain):
    """Requests of different settings share the batch and all complete; a seeded request is
    repeatable, and gives the same text among eleven others as sent alone."""
    async def go():
        c = plain.async_client()
        reqs = [c.completions.create(model="tiny", prompt=p, max_tokens=10, temperature=t, top_p=tp, seed=s)
                for p in PROMPTS[:4] for t, tp, s in [(0, None, None), (0.8, 0.9, None), (1.0, None, 7)]]
        return await asyncio.gather(*reqs)

    rs = asyncio.run(go())
    assert all(r.usage.completion_tokens >= 1 for r in rs)
    c = plain.client()
    a, b = (c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=10, temperature=1.0, seed=3)
            for _ in range(2))
    assert a.choices[0].text == b.choices[0].text
    assert rs[0].choices[0].text == reference(tiny, None, PROMPTS[0], 10, chat=False)
    alone = [c.completions.create(model="tiny", prompt=p, max_tokens=10, temperature=1.0, seed=7).choices[0].text
             for p in PROMPTS[:4]]
    assert [rs[3 * i + 2].choices[0].text for i in range(4)] == alone


# ---- load and disconnects -----------------------------------------------------------------------

async def load_round(srv: LiveServer, n: int, concurrency: int, max_tokens: int) -> list[tuple[int, str]]:
    """n requests, at most `concurrency` in flight; chat/completion, streamed or not, in turn.
    Returns (prompt index, text) per request; any failure raises."""
    c, sem = srv.async_client(), asyncio.Semaphore(concurrency)

    async def one(i: int):
        p, chat, stream = i % len(PROMPTS), i % 2 == 0, i % 4 < 2
        async with sem:
            if chat:
                kw = {"model": "tiny", "messages": [{"role": "user", "content": PROMPTS[p]}],
                      "max_tokens": max_tokens, "temperature": 0}
                if stream:
                    return p, "".join([ch.choices[0].delta.content or "" async for ch in
                                       await c.chat.completions.create(stream=True, **kw)])
                return p, (await c.chat.completions.create(**kw)).choices[0].message.content
            kw = {"model": "tiny", "prompt": PROMPTS[p], "max_tokens": max_tokens, "temperature": 0}
            if stream:
                return p, "".join([ch.choices[0].text async for ch in await c.completions.create(stream=True, **kw)])
            return p, (await c.completions.create(**kw)).choices[0].text

    try:
        return await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        await c.close()


def test_load_200_requests_at_concurrency_32(tiny, plain):
    want = {(p, chat): reference(tiny, None, PROMPTS[p], 12, chat) for p in range(len(PROMPTS)) for chat in (0, 1)}
    before = plain.metrics()
    rss = []
    for _ in range(2):  # a second identical round: memory stays flat
        out = asyncio.run(load_round(plain, 200, 32, 12))
        # batched, queued, streamed or not: every text equals the prompt's greedy output alone
        assert [t for _, t in out] == [want[(p, i % 2 == 0)] for i, (p, _) in enumerate(out)]
        wait_for(lambda: kv_empty(plain), 2.0)
        rss.append(rss_mb())
    m = plain.metrics()
    done = sum(m[f"eaglet:request_success_total{{finished_reason={r}}}"] -
               before[f"eaglet:request_success_total{{finished_reason={r}}}"] for r in ("stop", "length"))
    assert done == 400
    assert m["eaglet:request_failed_total"] == before["eaglet:request_failed_total"]
    assert m["eaglet:request_rejected_total"] == before["eaglet:request_rejected_total"]
    assert m["eaglet:time_to_first_token_seconds_count"] - before["eaglet:time_to_first_token_seconds_count"] == 400
    assert rss[1] - rss[0] < 16, f"memory grew {rss[1] - rss[0]:.1f} MB over an identical round"


def test_50_clients_drop_mid_stream(plain):
    m0 = plain.metrics()

    async def drop_after_first_tokens(client: httpx.AsyncClient, i: int):
        body = {"model": "tiny", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 200, "temperature": 0,
                "ignore_eos": True, "stream": True}
        async with client.stream("POST", plain.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= 2:
                    return  # leaving the block closes the connection mid-stream

    async def go():
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=100)) as client:
            await asyncio.gather(*(drop_after_first_tokens(client, i) for i in range(50)))

    t0 = time.perf_counter()
    asyncio.run(go())
    freed = wait_for(lambda: kv_empty(plain), 2.0)
    m = plain.metrics()
    assert m["eaglet:request_aborted_total"] - m0["eaglet:request_aborted_total"] == 50
    made = m["eaglet:generation_tokens_total"] - m0["eaglet:generation_tokens_total"]
    print(f"50 dropped streams: KV free count back to total {freed:.2f} s after the last drop "
          f"({time.perf_counter() - t0:.2f} s in all); {made:.0f} tokens generated of 50 x 200 asked")
    assert made < 50 * 200 / 4  # the rows stopped when their clients left, not at their budgets
    r = plain.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1


# ---- bad requests -------------------------------------------------------------------------------

CHAT, COMP = "/v1/chat/completions", "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]
BAD = [  # (what, method, path, body (str: raw), status, param)
    ("malformed JSON", "POST", CHAT, '{"model": "tiny", "messages": [', 400, None),
    ("body is not an object", "POST", CHAT, "[1, 2]", 400, None),
    ("missing model", "POST", CHAT, {"messages": MSGS}, 400, "model"),
    ("unknown model", "POST", CHAT, {"model": "gpt-9", "messages": MSGS}, 404, "model"),
    ("missing messages", "POST", CHAT, {"model": "tiny"}, 400, "messages"),
    ("empty messages", "POST", CHAT, {"model": "tiny", "messages": []}, 400, "messages"),
    ("messages not a list", "POST", CHAT, {"model": "tiny", "messages": "hi"}, 400, "messages"),
    ("unknown role", "POST", CHAT, {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages.[0].role"),
    ("content a number", "POST", CHAT, {"model": "tiny", "messages": [{"role": "user", "content": 5}]}, 400,
     "messages.[0].content"),
    ("content part not text", "POST", CHAT, {"model": "tiny", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages.[0].content"),
    ("temperature < 0", "POST", CHAT, {"model": "tiny", "messages": MSGS, "temperature": -0.5}, 400, "temperature"),
    ("temperature a string", "POST", CHAT, {"model": "tiny", "messages": MSGS, "temperature": "hot"}, 400,
     "temperature"),
    ("top_p 0", "POST", CHAT, {"model": "tiny", "messages": MSGS, "top_p": 0}, 400, "top_p"),
    ("top_p > 1", "POST", COMP, {"model": "tiny", "prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("temperature Infinity", "POST", COMP, '{"model": "tiny", "prompt": "x", "temperature": Infinity}', 400,
     "temperature"),
    ("seed out of range", "POST", COMP, {"model": "tiny", "prompt": "x", "seed": 2**70}, 400, "seed"),
    ("n > 1", "POST", CHAT, {"model": "tiny", "messages": MSGS, "n": 2}, 400, "n"),
    ("max_tokens 0", "POST", CHAT, {"model": "tiny", "messages": MSGS, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens a string", "POST", COMP, {"model": "tiny", "prompt": "x", "max_tokens": "10"}, 400, "max_tokens"),
    ("max_tokens beyond the context", "POST", CHAT, {"model": "tiny", "messages": MSGS, "max_tokens": 1000}, 400,
     "max_tokens"),
    ("prompt longer than the context", "POST", COMP, {"model": "tiny", "prompt": "the quick brown fox " * 200}, 400,
     "prompt"),
    ("chat longer than the context", "POST", CHAT, {"model": "tiny", "messages": [
        {"role": "user", "content": "the quick brown fox " * 200}]}, 400, "messages"),
    ("missing prompt", "POST", COMP, {"model": "tiny"}, 400, "prompt"),
    ("empty prompt", "POST", COMP, {"model": "tiny", "prompt": ""}, 400, "prompt"),
    ("several prompts", "POST", COMP, {"model": "tiny", "prompt": ["a", "b"]}, 400, "prompt"),
    ("token id outside the vocabulary", "POST", COMP, {"model": "tiny", "prompt": [5, 100000]}, 400, "prompt"),
    ("stream not a bool", "POST", CHAT, {"model": "tiny", "messages": MSGS, "stream": "yes"}, 400, "stream"),
    ("stop a number", "POST", CHAT, {"model": "tiny", "messages": MSGS, "stop": 5}, 400, "stop"),
    ("logprobs", "POST", CHAT, {"model": "tiny", "messages": MSGS, "logprobs": True}, 400, "logprobs"),
    ("echo", "POST", COMP, {"model": "tiny", "prompt": "x", "echo": True}, 400, "echo"),
    ("GET on a POST route", "GET", CHAT, None, 405, None),
    ("unknown path", "POST", "/v1/nothing", {}, 404, None),
]


@pytest.mark.parametrize("what,method,path,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_request(plain, what, method, path, body, status, param):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, str) else (
        {"json": body} if body is not None else {})
    r = httpx.request(method, plain.url + path, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
    if status == 404 and param == "model":
        assert err["code"] == "model_not_found"
    assert httpx.get(plain.url + "/health").status_code == 200


def test_bad_requests_through_the_client(plain):
    c = plain.client()
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="nope", messages=MSGS)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=MSGS, temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="tiny", prompt="x", n=3)


# ---- overload, internal failures, a dead engine -------------------------------------------------

def test_full_queue_is_429(tiny, monkeypatch):
    gate = threading.Event()
    gate_steps(monkeypatch, gate, sampled_only=False)
    body = {"model": "tiny", "prompt": "the quick", "max_tokens": 4, "temperature": 0}
    with LiveServer(Generator(tiny.model, tiny.tokenizer), max_batch=1, max_queue=1) as srv:
        async def go():
            async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
                first = asyncio.ensure_future(c.post("/v1/completions", json=body))  # takes the one row
                await asyncio.sleep(0.3)
                second = asyncio.ensure_future(c.post("/v1/completions", json=body))  # waits in the queue
                await asyncio.sleep(0.3)
                third = await c.post("/v1/completions", json=body)  # no room
                gate.set()
                return await first, await second, third

        a, b, full = asyncio.run(go())
        assert a.status_code == b.status_code == 200
        assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
        assert srv.metrics()["eaglet:request_rejected_total"] == 1
        assert httpx.get(srv.url + "/health").status_code == 200


def test_non_streaming_client_that_leaves_is_cancelled(tiny, monkeypatch):
    gate = threading.Event()
    gate_steps(monkeypatch, gate, sampled_only=False)
    with LiveServer(Generator(tiny.model, tiny.tokenizer), max_batch=2) as srv:
        body = {"model": "tiny", "prompt": "the quick", "max_tokens": 200, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/completions", json=body, timeout=0.5)  # gives up while the row is held
        gate.set()
        wait_for(lambda: kv_empty(srv), 2.0)
        m = srv.metrics()
        assert m["eaglet:request_aborted_total"] == 1 and m["eaglet:generation_tokens_total"] < 20


def test_internal_failure_fails_only_its_request(tiny, plain, monkeypatch, caplog):
    poison = 77  # a prompt ending in this token id breaks while its output is handled
    push = batcher_mod.Sequence.push

    def failing_push(self, tokens):
        if self.request.prompt[-1] == poison:
            raise RuntimeError("injected")
        return push(self, tokens)

    monkeypatch.setattr(batcher_mod.Sequence, "push", failing_push)
    failed = plain.metrics()["eaglet:request_failed_total"]

    async def go():
        async with httpx.AsyncClient(base_url=plain.url, timeout=30) as c:
            bad = {"model": "tiny", "prompt": [5, 6, poison], "max_tokens": 8, "temperature": 0}
            good = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0}
            return await asyncio.gather(c.post("/v1/completions", json=bad), c.post("/v1/completions", json=good),
                                        c.post("/v1/completions", json={**bad, "stream": True}))

    bad, good, bad_stream = asyncio.run(go())
    assert bad.status_code == 500 and bad.json()["error"]["type"] == "internal_error"
    assert "injected" in bad.json()["error"]["message"]
    assert good.status_code == 200 and good.json()["choices"][0]["text"] == reference(tiny, None, PROMPTS[1], 8, False)
    events = [line[6:] for line in bad_stream.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[-2])["error"]["type"] == "internal_error" and events[-1] == "[DONE]"
    assert "injected" in caplog.text  # logged
    assert plain.metrics()["eaglet:request_failed_total"] == failed + 2
    wait_for(lambda: kv_empty(plain), 2.0)
    assert httpx.get(plain.url + "/health").status_code == 200


def test_a_batch_that_cannot_start_fails_only_its_requests(tiny, monkeypatch):
    class NoMemory(batcher_mod.Batcher):
        failed = False  # the first batch fails to start, the next one starts

        def __init__(self, *args):
            if not NoMemory.failed:
                NoMemory.failed = True
                raise MemoryError("no room for the cache")
            super().__init__(*args)

    monkeypatch.setattr(engine_mod, "Batcher", NoMemory)
    with LiveServer(Generator(tiny.model, tiny.tokenizer)) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "temperature": 0.5})
        assert r.status_code == 500 and "no room" in r.json()["error"]["message"]
        r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "temperature": 0})
        assert r.status_code == 200 and httpx.get(srv.url + "/health").status_code == 200


def test_dead_engine_is_503(tiny, monkeypatch):
    def broken(self):
        raise RuntimeError("engine bug")

    monkeypatch.setattr(engine_mod.Engine, "next_admission", broken)
    with LiveServer(Generator(tiny.model, tiny.tokenizer)) as srv:
        assert httpx.get(srv.url + "/health").status_code == 200
        r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        h = httpx.get(srv.url + "/health")
        assert h.status_code == 503 and h.json()["error"]["code"] == "engine_dead"
        r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 503


# ---- the command --------------------------------------------------------------------------------

@pytest.mark.parametrize("engine_process", [False, True])
def test_eaglet_serve_equals_eaglet_generate(model_dir, capsys, monkeypatch, engine_process):
    """`eaglet serve` in its own process (and its engine in one more); its greedy chat reply equals
    `eaglet generate --chat`'s; the engine's log lines reach the server's output."""
    monkeypatch.setenv("EAGLET_CACHE", str(model_dir.parent / "cache"))
    flags = ["--model", str(model_dir), "--device", "cpu", "--spec", "ngram", "--spec-steps", "3"]
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "eaglet", "serve", *flags, "--port", str(port),
                             "--served-model-name", "tiny", "--max-batch", "4", "--log-level", "info",
                             "--engine-process" if engine_process else "--no-engine-process"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        prompt = "the quick brown fox"
        rc = main(["generate", "--chat", prompt, "--max-new-tokens", "20", *flags])
        want = capsys.readouterr().out[:-1]  # the text, then a newline
        assert rc == 0

        def up():
            assert proc.poll() is None, proc.stdout.read()
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
            except httpx.TransportError:
                return False
        wait_for(up, 60)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=20,
                                      temperature=0)
        assert r.choices[0].message.content == want
        assert r.usage.accept_length is not None
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "INFO eaglet.server: a batch of 1 request starts" in out  # from the engine's thread or process


def test_serve_flags_are_checked(capsys):
    assert main(["serve", "--max-batch", "0"]) == 1
    assert "--max-batch" in capsys.readouterr().err
    assert main(["serve", "--spec-multi-step", "0"]) == 1
    assert "--spec-multi-step must be >= 1" in capsys.readouterr().err


def test_queued_chunks_go_out_as_one(tiny):
    """A stream that fell behind the engine gets one chunk for all it has queued: the texts joined,
    the tokens summed, the last one's finish and counters; text queued before an error still goes
    out, then the error alone."""
    from eaglet.sampling import SamplingParams
    from eaglet.server.engine import Chunk, Engine, Request
    from eaglet.server.metrics import ServerMetrics
    from eaglet.server.protocol import APIError
    from eaglet.spec.metrics import SpecMetrics

    engine = Engine(Generator(tiny.model, tiny.tokenizer), 2, 4, 64, ServerMetrics("t"))

    async def read(chunks: list[Chunk]) -> list[Chunk]:
        req = Request([1, 2], 8, SamplingParams(0.0))
        req.queue, req.done = asyncio.Queue(), True
        for c in chunks:
            req.queue.put_nowait(c)
        return [c async for c in engine.chunks(req)]

    spec = SpecMetrics(drafts=2, draft_tokens=6, accepted_tokens=3)
    got = asyncio.run(read([Chunk("a", 1), Chunk("bc", 2), Chunk("d", 1, "length", 4, spec)]))
    assert got == [Chunk("abcd", 4, "length", 4, spec)]
    err = APIError(500, "boom", "internal_error")
    got = asyncio.run(read([Chunk("a", 1), Chunk("b", 1), Chunk("", 0, error=err)]))
    assert got == [Chunk("ab", 2), Chunk("", 0, error=err)]


def test_streamed_events_are_the_protocol_models(plain):
    """The streamed text events (their JSON spliced around each text, not rendered per chunk) are
    byte for byte what the pydantic models render, for chat and completions."""
    from eaglet.server.protocol import ChatChunk, TextCompletion

    for path, body, model in (("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[0]}]},
                               ChatChunk),
                              ("/v1/completions", {"prompt": PROMPTS[1]}, TextCompletion)):
        lines = []
        with httpx.stream("POST", plain.url + path, json={"model": "tiny", "max_tokens": 12, "temperature": 0,
                                                          "stream": True, **body}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    lines.append(line[6:])
        def text(line: str) -> str | None:
            choices = model.model_validate_json(line).choices
            if not choices:
                return None
            return choices[0].text if model is TextCompletion else choices[0].delta.content

        texts = [line for line in lines if text(line)]
        assert len(texts) >= 2
        for line in texts:
            assert model.model_validate_json(line).model_dump_json() == line

