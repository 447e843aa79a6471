"""Python's garbage collector under a loaded `eaglet serve`: the time each collection generation
stopped the process (every thread: the engine's and the event loop's), with the server's startup
objects frozen (what app.py does after warm-up: gc.collect(); gc.freeze()) and without. SmolLM2
served in this process on the CPU with the model's cost taken away (serve_host_load.py's replay-free
steps), `eaglet bench-serve` at concurrency 64 from its own process, 256 requests of 128 tokens a
round. The pauses come from eaglet's own counter (server/metrics.py, GCPauses). A probe, CPU.

  .venv/bin/python bench/cpu/gc_pauses.py [--rounds 3] [--systems plain tree:4,4,16]
"""
import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from inprocess import bench_serve, serving  # noqa: E402
from serve_host_load import model_without_cost, system  # noqa: E402

from eaglet.generate import Generator  # noqa: E402
from eaglet.perf.record import write_record  # noqa: E402
from eaglet.sampling import SamplingParams  # noqa: E402
from eaglet.server.app import build_app  # noqa: E402
from eaglet.server.metrics import GCPauses  # noqa: E402
from eaglet.spec.speculator import bundled_drafter  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--systems", nargs="+", default=["plain", "tree:4,4,16"])
    ap.add_argument("--prompts", default=".gpudata/sharegpt_first_turns.json")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    loaded, base = model_without_cost(3)
    GCPauses.install()
    freeze = gc.freeze
    results = {"objects_tracked": len(gc.get_objects())}
    port = 8071
    for frozen in (False, True):
        gc.freeze = freeze if frozen else (lambda: None)  # app.py's lifespan calls gc.freeze()
        for name in args.systems:
            gen = Generator(loaded.model, loaded.tokenizer, system(base, name))
            app = build_app(gen, "m", max_batch=64, max_len=1024)
            with torch.inference_mode():  # every row bucket's one real step before any timing
                dec = gen.decoder(64, 1024)
                dec.graphs.enabled = True
                dec.warmup(prompt_tokens=16)
                dec.graphs.enabled = False
            rounds = []
            port += 1
            with serving(app, port):
                bench_serve(port, args.prompts, 256, 64)  # warm-up round
                for _ in range(args.rounds):
                    s0, n0 = list(GCPauses.seconds), list(GCPauses.collections)
                    rec = bench_serve(port, args.prompts, 256, 64)
                    rounds.append({"output_tok_s": rec["output_throughput"],
                                   "gc_ms": [1e3 * (a - b) for a, b in zip(GCPauses.seconds, s0)],
                                   "collections": [a - b for a, b in zip(GCPauses.collections, n0)]})
            key = f"{name} {'frozen' if frozen else 'not frozen'}"
            results[key] = rounds
            for r in rounds:
                print(f"{key:<24} {r['output_tok_s']:8.0f} tok/s; gc ms by generation "
                      + " ".join(f"{t:7.1f}" for t in r["gc_ms"]) + f" ({'/'.join(map(str, r['collections']))} "
                      "collections)", flush=True)
    gc.freeze = freeze
    print("record:", write_record("gc-pauses", vars(args), results, args.out,
                                  models={"target": loaded.path, "drafter": str(bundled_drafter())}))


if __name__ == "__main__":
    main()
