"""Where the host's time goes while eaglet decodes SmolLM2 on the GPU (plain and an EAGLE-3 chain):
cProfile over a few generate calls after warm-up, the top functions by own time, and how much of
the wall time the host spent waiting for the GPU (CUDA event synchronize). A probe, not part of
the package.

  python3 bench/gpu/host_profile.py MODEL.gguf DRAFTER_DIR OUT_DIR
  python3 bench/gpu/host_profile.py --steps MODEL.gguf DRAFTER_DIR OUT_DIR [TREE ...]
      # no profiler: per step, the host's time in graph replays (cudaGraphLaunch), in waiting for
      # the GPU, and in everything else, against the wall time; plain, chain 5 and each tree
      # (STEPS,TOPK,TOKENS). A step whose wait is near 0 is bound by the host, not the GPU.
"""
import cProfile
import io
import pstats
import sys
import time

import torch
from step_profile import generators, setup  # this folder is on the path when run as a script

from eaglet.generate import Generator
from eaglet.runtime.decoder import Decoder
from eaglet.perf.record import write_record


def main(model_path: str, draft: str, out_dir: str) -> None:
    loaded, ids, cfg, sp = setup(model_path, draft)
    model, tok = loaded.model, loaded.tokenizer
    report, results = [], {}
    for name, gen in (("plain", Generator(model, tok)), ("eagle3-chain5", Generator(model, tok, sp))):
        for _ in range(3):
            gen.generate([ids], cfg)
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        for _ in range(5):
            gen.generate([ids], cfg)
        torch.cuda.synchronize()
        prof.disable()
        wall = time.perf_counter() - t0
        s = io.StringIO()
        st = pstats.Stats(prof, stream=s)
        # builtins are named like "<function Event.synchronize at 0x...>": match by substring
        waits = sum(v[2] for k, v in st.stats.items() if "synchronize" in k[2] or "tolist" in k[2])
        st.sort_stats("tottime").print_stats(28)
        report.append(f"== {name}: wall {wall * 1e3:.1f} ms for 5 x 128 tokens (under cProfile); "
                      f"waiting in synchronize/tolist {waits * 1e3:.1f} ms\n{s.getvalue()}")
        results[name] = {"wall_ms": wall * 1e3, "wait_ms": waits * 1e3, "wait_share": waits / wall,
                         "top_by_own_time": s.getvalue()}
    print("\n".join(report))
    path = write_record("host-profile", {"model": model_path, "draft": draft, "max_new_tokens": 128, "runs": 5},
                        results, out_dir, models={"target": loaded.path, "drafter": draft})
    print(f"record: {path}")


class Clock:
    """Host seconds spent inside a patched callable, summed."""

    def __init__(self, owner, name: str):
        self.owner, self.name, self.orig, self.total, self.calls = owner, name, getattr(owner, name), 0.0, 0
        orig = self.orig

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                self.total += time.perf_counter() - t
                self.calls += 1
        setattr(owner, name, timed)

    def restore(self) -> None:
        setattr(self.owner, self.name, self.orig)


def main_steps(model_path: str, draft: str, out_dir: str, trees: list[str]) -> None:
    loaded, ids, cfg, sp = setup(model_path, draft)
    gens = generators(loaded, sp, model_path, draft, trees)
    results, runs = {}, 5
    for name, gen in gens.items():
        for _ in range(3):
            gen.generate([ids], cfg)
        torch.cuda.synchronize()
        clocks = {"replay": Clock(torch.cuda.CUDAGraph, "replay"), "wait": Clock(torch.cuda.Event, "synchronize"),
                  "launch": Clock(Decoder, "launch"), "collect": Clock(Decoder, "collect")}
        t0 = time.perf_counter()
        steps = 0
        for _ in range(runs):
            c = gen.generate([ids], cfg)[0]
            steps += (len(c.tokens) - 1) if c.spec is None else c.spec.drafts
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        for k in clocks.values():
            k.restore()
        per = {k: v.total * 1e6 / steps for k, v in clocks.items()}
        r = {"steps": steps, "wall_us_per_step": wall * 1e6 / steps,
             "replay_us_per_step": per["replay"], "replays_per_step": clocks["replay"].calls / steps,
             "wait_us_per_step": per["wait"],
             "launch_other_us_per_step": per["launch"] - per["replay"],
             "collect_other_us_per_step": per["collect"] - per["wait"]}
        r["rest_us_per_step"] = r["wall_us_per_step"] - per["launch"] - per["collect"]
        results[name] = r
        print(f"{name}: {steps} steps, wall {r['wall_us_per_step']:.0f} us/step: graph replays "
              f"{r['replay_us_per_step']:.0f} ({r['replays_per_step']:.1f} a step), rest of launch "
              f"{r['launch_other_us_per_step']:.0f}, waiting for the GPU {r['wait_us_per_step']:.0f}, rest of "
              f"collect {r['collect_other_us_per_step']:.0f}, outside both {r['rest_us_per_step']:.0f}")
    path = write_record("host-steps", {"model": model_path, "draft": draft, "max_new_tokens": 128, "runs": runs,
                                       "trees": trees}, results, out_dir, models={"target": loaded.path, "drafter": draft})
    print(f"record: {path}")


if __name__ == "__main__":
    if sys.argv[1] == "--steps":
        main_steps(*sys.argv[2:5], sys.argv[5:])
    else:
        main(*sys.argv[1:4])
