"""Which batch-1 matmul is fastest on this GPU: cuBLAS (F.linear) against a Triton GEMV, for the
projection shapes of Llama-3.1-8B (where bandwidth decides) or SmolLM2-135M (where each call is a
few microseconds and latency decides). Prints achieved GB/s and µs per call (50 calls back to back
in one CUDA graph); a probe for choosing the decode matmul, not part of the package.

  python3 bench/gpu/gemv_probe.py OUT_DIR [llama-3.1-8b | smollm2-135m]
"""
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from eaglet.perf.record import write_record


@triton.jit
def gemv(x_ptr, w_ptr, y_ptr, N, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        w = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=(rows[:, None] < N) & (cols[None, :] < K),
                    other=0.0)
        x = tl.load(x_ptr + cols, mask=cols < K, other=0.0)
        acc += w.to(tl.float32) * x[None, :].to(tl.float32)
    tl.store(y_ptr + rows, tl.sum(acc, 1).to(y_ptr.dtype.element_ty), mask=rows < N)


def run_triton(x, w, bn, bk, warps):
    n, k = w.shape
    y = torch.empty(n, dtype=x.dtype, device=x.device)
    gemv[(triton.cdiv(n, bn),)](x, w, y, n, k, BN=bn, BK=bk, num_warps=warps)
    return y


def bench(fn, reps=50):
    for _ in range(3):
        fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps


results = {}
SHAPES = {
    "llama-3.1-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
                     "lm_head": (128256, 4096)},
    "smollm2-135m": {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
                     "lm_head": (49152, 576)},
}
shapes = SHAPES[sys.argv[2] if len(sys.argv) > 2 else "llama-3.1-8b"]
for name, (n, k) in shapes.items():
    w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
    x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
    ref = F.linear(x, w)
    gb = n * k * 2 / 1e9
    ms = bench(lambda: F.linear(x, w))
    line = f"{name:<8} {n}x{k}  cublas {gb / ms * 1e3:7.0f} GB/s {ms * 1e3:6.2f} us"
    best = None
    for bn, bk, warps in [(4, 512, 4), (8, 256, 4), (8, 512, 4), (16, 256, 8), (2, 1024, 4), (4, 1024, 8),
                          (1, 512, 2), (2, 256, 2), (4, 128, 2), (8, 64, 1)]:
        y = run_triton(x[0], w, bn, bk, warps)
        err = (y.float() - ref[0].float()).abs().max().item()
        bw = gb / bench(lambda: run_triton(x[0], w, bn, bk, warps)) * 1e3
        if best is None or bw > best[0]:
            best = (bw, bn, bk, warps, err)
    line += (f"  triton best {best[0]:7.0f} GB/s {gb / best[0] * 1e6:6.2f} us (BN={best[1]} BK={best[2]} "
             f"warps={best[3]}, max err {best[4]:.3g})")
    print(line, flush=True)
    results[name] = {"shape": [n, k], "cublas_gb_s": gb / ms * 1e3, "cublas_us": ms * 1e3,
                     "triton_best_gb_s": best[0], "triton_best_us": gb / best[0] * 1e6,
                     "triton_config": best[1:4], "triton_max_err": best[4]}
print(write_record("gemv-probe", {"argv": sys.argv}, results, sys.argv[1] if len(sys.argv) > 1 else "/tmp"))
