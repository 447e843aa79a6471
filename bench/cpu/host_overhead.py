"""The host's time per decoding step with the device's work taken away. Every step body that the
graph runner keys (prefill, decode, draft, verify, accept) runs once, to make its outputs, and
after that returns them at once, as a CUDA graph replay nearly does on the host. What is left is
what the host does for each step: the decoder's Python, the speculation bookkeeping, the
Generator's streaming and detokenizing, the small host-to-device copies. On the GPU, lookahead
overlaps this with the device's work on the next step, so a step costs the longer of the two: a
host time near a step's GPU time (H200: plain ~0.63 ms, EAGLE-3 chain 5 ~1.3 ms) leaves the GPU
idle. Measured on this machine's CPU, which is not the GPU machine's. A probe, CPU.

  .venv/bin/python bench/cpu/host_overhead.py [--max-new-tokens 256] [--repeats 5] [--out bench/results]
"""
import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch

from eaglet.config import SpecConfig
from eaglet.datasets import load_prompts
from eaglet.generate import GenerationConfig, Generator
from eaglet.perf.record import write_record
from eaglet.runtime.graphs import GraphRunner
from eaglet.spec.speculator import bundled_drafter, load_speculator
from eaglet.weights import load_model


def replay_free(self, key, body, graph=True):
    """GraphRunner.run with the device's work gone: the first call of a key runs the body; later
    calls return its outputs as they are."""
    done = self.__dict__.setdefault("_outputs", {})
    if key not in done:
        done[key] = body()
    return done[key]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    loaded = load_model(None, "float32", "cpu")
    model, tok = loaded.model, loaded.tokenizer
    prompt = tok.apply_chat([{"role": "user", "content": load_prompts("mtbench")[0]}])
    spec = load_speculator(SpecConfig("eagle3", str(bundled_drafter()), steps=5), model)
    systems = {"plain": Generator(model, tok), "eagle3-chain": Generator(model, tok, spec)}
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    GraphRunner.run = replay_free
    results = {}
    for name, gen in systems.items():
        gen.generate([prompt], cfg)  # the first call of every key does the work
        times, steps = [], 0
        for _ in range(args.repeats):
            dec = gen.decoder_in_use()
            launches = [0]
            inner = dec.launch
            dec.launch = lambda inner=inner: launches.__setitem__(0, launches[0] + 1) or inner()
            t0 = time.perf_counter()
            gen.generate([prompt], cfg)
            times.append(time.perf_counter() - t0)
            del dec.launch
            steps = launches[0]
        prof = cProfile.Profile()
        prof.enable()
        gen.generate([prompt], cfg)
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(15)
        ms = statistics.median(times) * 1e3
        results[name] = {"ms_per_call": ms, "steps": steps, "ms_per_step": ms / steps,
                         "seconds": times, "profile_top": s.getvalue().splitlines()[:40]}
        print(f"{name:<14} {steps} steps, host {ms / steps:.3f} ms a step ({ms:.1f} ms a call of "
              f"{args.max_new_tokens} tokens)", flush=True)
    print(write_record("host-overhead", vars(args), results, args.out,
                       models={"target": loaded.path, "drafter": str(bundled_drafter())}))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
