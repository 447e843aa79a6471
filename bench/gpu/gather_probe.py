"""Token embedding lookups on the GPU: F.embedding (CUDA index_select) against indexing
(`weight[ids]`, eaglet.models.llama.embed) for 1 to 64 ids from SmolLM2's 49152 x 576 bfloat16
table (and a draft vocabulary's 32000 rows), each as a CUDA graph of 20 lookups replayed; median µs
per lookup over 7 replays after warm-up, and whether both give the same rows. A probe, not part of
the package.

  python3 bench/gpu/gather_probe.py OUT_DIR
"""
import statistics
import sys

import torch
import torch.nn.functional as F

from eaglet.models.llama import embed
from eaglet.perf.record import write_record

REPS = 20


def timed(fn) -> float:
    for _ in range(3):
        fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(REPS):
            fn()
    times = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / REPS)
    return statistics.median(times)


def main(out_dir: str) -> None:
    dev = torch.device("cuda")
    results = []
    for rows in (49152, 32000):
        w = torch.randn(rows, 576, dtype=torch.bfloat16, device=dev)
        for n in (1, 4, 16, 64):
            ids = torch.randint(0, rows, (1, n), device=dev)
            same = torch.equal(F.embedding(ids, w), embed(w, ids))
            r = {"table_rows": rows, "ids": n, "same": same,
                 "embedding_us": timed(lambda: F.embedding(ids, w)), "index_us": timed(lambda: embed(w, ids))}
            results.append(r)
            print(f"{rows} rows, {n:3d} ids: F.embedding {r['embedding_us']:.2f} us, indexing {r['index_us']:.2f} us, "
                  f"same {same}")
    print("record:", write_record("gather-probe", {}, {"lookups": results}, out_dir))


if __name__ == "__main__":
    main(sys.argv[1])
