"""The engine thread's own work for one step of a full batch, with the model's cost taken away
(host_overhead.py's replay_free): Batcher.step over 64 running rows of SmolLM2 (the decoder's
bookkeeping, stopping, detokenizing, the draft counters), plain against speculation settings whose
rows emit --tokens-per-step tokens a step. No HTTP side: on a loaded server this thread shares the
GIL with the event loop, so every millisecond here is one the event loop waits. Median over steps,
after 20 warm-up steps (a 1024-token cache a row). A probe, CPU; its host is not the GPU machine's.

  .venv/bin/python bench/cpu/batcher_step.py [--systems plain chain:4 tree:4,4,16] [--rows 64]
"""
import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from serve_host_load import model_without_cost, system  # noqa: E402

from eaglet.generate import Generator  # noqa: E402
from eaglet.perf.record import write_record  # noqa: E402
from eaglet.sampling import SamplingParams  # noqa: E402
from eaglet.server.batcher import Batcher  # noqa: E402
from eaglet.spec.speculator import bundled_drafter  # noqa: E402


@dataclasses.dataclass(eq=False)
class Request:  # what a Batcher reads of an engine request
    prompt: list[int]
    max_tokens: int = 1 << 20
    stop: tuple = ()
    ignore_eos: bool = True
    sampling: SamplingParams = SamplingParams()
    id: str = "probe"
    row: int | None = None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--systems", nargs="+", default=["plain", "chain:4", "tree:4,4,16"])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--tokens-per-step", type=int, default=3)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    loaded, base = model_without_cost(args.tokens_per_step)
    prompt = loaded.tokenizer.apply_chat([{"role": "user", "content": "Write a long story about a fox."}])
    results = {}
    with torch.inference_mode():
        for name in args.systems:
            # a cache of 1024 a row: the prompt and (20 + steps) x tokens-per-step fit
            b = Batcher.of(Generator(loaded.model, loaded.tokenizer, system(base, name)), args.rows, 1024)
            b.add([Request(prompt) for _ in range(args.rows)])
            times, tokens = [], 0
            for i in range(20 + args.steps):
                t = time.perf_counter()
                out = b.step()
                if i >= 20:
                    times.append(time.perf_counter() - t)
                    tokens += sum(o.tokens for o in out)
            ms = statistics.median(times) * 1e3
            results[name] = {"step_ms_median": ms, "tokens_per_step": tokens / args.steps,
                             "us_per_token": ms * 1e3 / (tokens / args.steps)}
            print(f"{name:<14} {ms:6.3f} ms a step, {tokens / args.steps:5.1f} tokens a step, "
                  f"{results[name]['us_per_token']:5.2f} µs a token", flush=True)
    print("record:", write_record("batcher-step", vars(args), results, args.out,
                                  models={"target": loaded.path, "drafter": str(bundled_drafter())}))


if __name__ == "__main__":
    main()
