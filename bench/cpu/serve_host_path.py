"""Where a request's time goes in `eaglet serve` when the model costs nothing: SmolLM2 on the CPU
with every graph-runner step body run once and its outputs returned after that (host_overhead.py's
replay_free), so what is left is the server's host path: HTTP, tokenizing, the engine thread, the
SSE stream. The server runs in this process (uvicorn in a thread) once per HTTP stack (uvicorn's
asyncio + h11, then uvloop + httptools); `eaglet bench-serve` loads it from its own process (1
client, 128-token ShareGPT requests, EOS ignored; a warm-up run, then ROUNDS timed ones). Per
request the server stamps, from the moment its app is called: the handler queueing the request
with the engine (tokenized), the response's start, the engine starting and ending the admission,
the first flush to the event loop, the loop taking the chunk, and the first token's event sent.
Medians over the timed requests. A probe, CPU; its host is not the GPU machine's.

  .venv/bin/python bench/cpu/serve_host_path.py [--prompts FILE] [--rounds 3] [--out bench/results]
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from host_overhead import replay_free  # noqa: E402
from inprocess import bench_serve, serving  # noqa: E402

from eaglet.generate import Generator  # noqa: E402
from eaglet.perf.record import write_record  # noqa: E402
from eaglet.runtime.graphs import GraphRunner  # noqa: E402
from eaglet.server import engine as E  # noqa: E402
from eaglet.server.app import build_app  # noqa: E402
from eaglet.weights import load_model  # noqa: E402

STAMPS = ["queued", "response_start", "admit_start", "admit_end", "flushed", "loop_took", "first_sent", "end"]


class Timeline:
    """ASGI middleware and engine hooks that stamp each chat request (one at a time: concurrency 1)."""

    def __init__(self, app):
        self.app, self.rows, self.cur = app, [], {}
        o_open, o_add, o_flush, o_put = E.Engine.open, E.Batcher.add, E.Engine._flush, E.put_all
        tl = self

        def open_(eng, req):
            tl.stamp("queued")
            return o_open(eng, req)

        def add(b, reqs):
            tl.stamp("admit_start")
            out = o_add(b, reqs)
            tl.stamp("admit_end")
            return out

        def flush(eng):
            if eng.outbox:
                tl.stamp("flushed")
            return o_flush(eng)

        def put_all(items):
            tl.stamp("loop_took")
            return o_put(items)

        E.Engine.open, E.Batcher.add, E.Engine._flush, E.put_all = open_, add, flush, put_all

    def stamp(self, key: str) -> None:
        if self.cur and key not in self.cur:
            self.cur[key] = time.perf_counter()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/v1/chat/completions":
            return await self.app(scope, receive, send)
        t = self.cur = {"in": time.perf_counter()}
        bodies = [0]

        async def timed_send(msg):
            if msg["type"] == "http.response.start":
                t.setdefault("response_start", time.perf_counter())
            elif msg["type"] == "http.response.body":
                bodies[0] += 1
                if bodies[0] == 2:  # the first is the role chunk
                    t.setdefault("first_sent", time.perf_counter())
            await send(msg)

        await self.app(scope, receive, timed_send)
        t["end"] = time.perf_counter()
        self.rows.append(t)

    def medians(self, rows) -> dict:
        return {k: statistics.median((r[k] - r["in"]) * 1000 for r in rows if k in r) for k in STAMPS}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", default=".gpudata/sharegpt_first_turns.json")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    torch.set_num_threads(1)
    GraphRunner.run = replay_free
    loaded = load_model(None, "float32", "cpu")
    gen = Generator(loaded.model, loaded.tokenizer)
    results = {}
    for port, (loop, http) in enumerate([("asyncio", "h11"), ("uvloop", "httptools")], start=8061):
        tl = Timeline(build_app(gen, "m", max_batch=4, max_len=1024))
        rounds = []
        with serving(tl, port, loop, http):
            for r in range(args.rounds + 1):
                rec = bench_serve(port, args.prompts, args.num_requests, 1)
                if r:  # round 0 warms up
                    rounds.append({"output_tok_s": rec["output_throughput"], "ttft_ms_median": rec["ttft_ms"]["median"],
                                   "e2e_ms_mean": rec["e2e_ms"]["mean"], "server_ttft_ms": rec["server_ttft_ms"],
                                   "client_event_loop": rec["client_event_loop"],
                                   "server_ms_median": tl.medians(tl.rows[-args.num_requests:])})
        name = f"{loop}+{http}"
        results[name] = rounds
        for x in rounds:
            print(f"{name}: {x['output_tok_s']:.0f} tok/s, TTFT {x['ttft_ms_median']:.2f} ms (server {x['server_ttft_ms']:.2f}), "
                  f"e2e {x['e2e_ms_mean']:.1f} ms; from app entry, ms: "
                  + " ".join(f"{k} {v:.2f}" for k, v in x["server_ms_median"].items()))
    print("record:", write_record("serve-host-path", vars(args), results, args.out))


if __name__ == "__main__":
    main()
