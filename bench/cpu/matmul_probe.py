"""Which formulation of a few-row matmul streams weights fastest on this CPU: F.linear (x @ Wᵀ),
against W @ xᵀ (one row padded to two). SmolLM2-135M's shapes, 30 layers of distinct weights plus
the 49,152-row output layer, so every weight comes from memory as in a real forward. Prints ms per
forward's worth of matmuls for each row count and writes a record; a probe for choosing
eaglet.models.linear, not part of the package.

    .venv/bin/python bench/cpu/matmul_probe.py bench/results
"""
import sys
import time

import torch
import torch.nn.functional as F

from eaglet.perf.record import write_record

LAYERS = 30
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate+up, down (out, in)
VOCAB = 49152


def w_xt(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    m = x.shape[0]
    if m == 1:
        x = torch.cat([x, x])
    return (w @ x.t()).t()[:m]


def sweep(fn, weights, head, m: int, reps: int = 5) -> tuple[float, float]:
    xs = {k: torch.randn(m, k) for k in (576, 1536)}
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for layer in weights:
            for w in layer:
                fn(xs[w.shape[1]], w)
        t1 = time.perf_counter()
        fn(xs[576], head)
        times.append(((t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3))
    times.sort()
    return times[reps // 2]  # median by layer time


def main(out: str) -> None:
    torch.manual_seed(0)
    weights = [[torch.randn(n, k) for n, k in SHAPES] for _ in range(LAYERS)]
    head = torch.randn(VOCAB, 576)
    results = {}
    for name, fn in [("F.linear", lambda x, w: F.linear(x, w)), ("W @ x^T", w_xt)]:
        for m in (1, 2, 3, 4, 6, 8, 16, 32, 64):
            layers, out_layer = sweep(fn, weights, head, m)
            results[f"{name} rows={m}"] = {"layers_ms": layers, "output_layer_ms": out_layer,
                                           "total_ms": layers + out_layer}
            print(f"{name:9} rows {m:3}: layers {layers:6.1f} ms  output layer {out_layer:6.1f} ms")
    print(f"record: {write_record('matmul-probe', {'threads': torch.get_num_threads()}, results, out)}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench/results")
