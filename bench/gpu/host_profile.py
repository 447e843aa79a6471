"""Where the host's time goes while eaglet decodes SmolLM2 on the GPU (plain and an EAGLE-3 chain):
cProfile over a few generate calls after warm-up, the top functions by own time, and how much of
the wall time the host spent waiting for the GPU (CUDA event synchronize). A probe, not part of
the package.

  python3 bench/gpu/host_profile.py MODEL.gguf DRAFTER_DIR OUT_DIR
"""
import cProfile
import io
import pstats
import sys
import time

import torch
from step_profile import setup  # this folder is on the path when run as a script

from eaglet.generate import Generator
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


if __name__ == "__main__":
    main(*sys.argv[1:4])
