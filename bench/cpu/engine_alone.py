"""What the HTTP side costs the engine: the replay-free probe's server (serve_host_load.py: SmolLM2
on the CPU, every step body run once and its outputs replayed, so a step costs only host work) driven
two ways at the same concurrency, alternating rounds: its Engine alone, fed by a bare asyncio client
in this process (requests tokenized beforehand, chunks read and dropped: no HTTP, no JSON), and the
same engine behind FastAPI with `eaglet bench-serve` in its own process. The engine detokenizes and
streams either way; the difference is the event loop's HTTP work sharing the engine's GIL (and, on a
machine with few cores, the client's process). Third, the same engine in a process of its own
(`serve --engine-process`, server/remote.py) behind FastAPI in this one. It runs on any machine's CPUs.

  .venv/bin/python bench/cpu/engine_alone.py [--systems plain tree:4,4,16] [--concurrency 16] [--rounds 3]
"""
import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from inprocess import bench_serve, serving  # noqa: E402
from serve_host_load import model_without_cost, replay_free_engine, system, warm_replay_free  # noqa: E402

from eaglet.generate import Generator  # noqa: E402
from eaglet.perf.record import write_record  # noqa: E402
from eaglet.sampling import SamplingParams  # noqa: E402
from eaglet.server.app import build_app, serve_app  # noqa: E402
from eaglet.server.remote import EngineClient  # noqa: E402
from eaglet.server.request import Request  # noqa: E402

TOKENS = 128


async def bare(engine, prompts: list[list[int]], concurrency: int) -> float:
    """Every prompt through the engine, `concurrency` at a time: output tok/s."""
    gate = asyncio.Semaphore(concurrency)

    async def one(ids):
        async with gate:
            req = Request(ids, TOKENS, SamplingParams(0.0), (), True)
            engine.open(req)
            async for _ in engine.chunks(req):
                pass
    t = time.perf_counter()
    await asyncio.gather(*(one(p) for p in prompts))
    return len(prompts) * TOKENS / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--systems", nargs="+", default=["plain", "tree:4,4,16"])
    ap.add_argument("--prompts", default=".gpudata/sharegpt_first_turns.json")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--num-requests", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--multi-step", type=int, default=4, help="plain steps a host round trip (serve's GPU default)")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    loaded, base = model_without_cost(3)
    turns = [c["conversations"][0]["value"][:600] for c in json.load(open(args.prompts))[:args.num_requests]]
    prompts = [loaded.tokenizer.apply_chat([{"role": "user", "content": t}]) for t in turns]
    results = {}
    for port, name in enumerate(args.systems, start=8095):
        multi = args.multi_step if name == "plain" else None
        gen = Generator(loaded.model, loaded.tokenizer, system(base, name))
        app = build_app(gen, "m", max_batch=args.concurrency, max_len=1024, multi_step=multi)
        engine = app.state.engine
        warm_replay_free(engine)
        engine.start()
        remote = serve_app(EngineClient(replay_free_engine, name, 3, args.concurrency, multi))
        runs = {"alone": [], "http": [], "process": []}
        with serving(app, port), serving(remote, port + 10):
            asyncio.run(bare(engine, prompts, args.concurrency))  # warm-up of each way
            bench_serve(port, args.prompts, args.num_requests, args.concurrency)
            bench_serve(port + 10, args.prompts, args.num_requests, args.concurrency)
            for _ in range(args.rounds):
                runs["alone"].append(asyncio.run(bare(engine, prompts, args.concurrency)))
                runs["http"].append(bench_serve(port, args.prompts, args.num_requests, args.concurrency)["output_throughput"])
                runs["process"].append(bench_serve(port + 10, args.prompts, args.num_requests,
                                                   args.concurrency)["output_throughput"])
        engine.shutdown()
        med = {k: statistics.median(v) for k, v in runs.items()}
        results[name] = {"rounds": runs, "median_tok_s": med, "alone_over_http": med["alone"] / med["http"],
                         "process_over_http": med["process"] / med["http"]}
        print(f"{name:<14} alone {med['alone']:8.0f} tok/s, behind HTTP {med['http']:8.0f} "
              f"({med['alone'] / med['http']:.2f}x), engine process behind HTTP {med['process']:8.0f} "
              f"({med['process'] / med['http']:.2f}x)", flush=True)
    print("record:", write_record("engine-alone", vars(args), results, args.out))


if __name__ == "__main__":
    main()
