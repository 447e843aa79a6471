"""One row times a weight matrix (y = x Wᵀ + b for a single token: decoding, drafting) as a Triton
GEMV, used by models/linear.py on the GPU in place of cuBLAS.

At batch 1 a projection is a stream of weight bytes. cuBLAS picks kernels built for matrices (tiles
of 64 to 128 output rows, split-K with a second reduction kernel for the narrow ones) that reach
2.5 to 4.2 TB/s on the H200 for Llama-3.1-8B's projections; this kernel, one program per output row
reading the row in 1024-wide slices, reaches 3.5 to 4.4 TB/s on the same weights
(bench/gpu/layer_probe.py, BENCHMARKS.md). The sum runs in float32 in slice order, so results differ
from cuBLAS's by rounding only.

Enabled by runtime/compile.py for float16 and bfloat16 on the GPU; `EAGLET_GEMV=0` keeps cuBLAS (for
side-by-side runs). Under TRITON_INTERPRET=1 (the CPU tests) it runs on any device.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without Triton
    triton = None

_on = False
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def enable(on: bool = True) -> None:
    global _on
    _on = on and os.environ.get("EAGLET_GEMV", "1") != "0"


def usable(x: torch.Tensor, weight: torch.Tensor, rows: int) -> bool:
    return (_on and triton is not None and rows == 1 and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and weight.is_contiguous() and not torch.is_grad_enabled()
            and (x.is_cuda or INTERPRET))


def tiles(n: int, k: int) -> tuple[int, int, int]:
    """(output rows per program, slice width, warps), from the probe: one row per program in 1024-wide
    slices won on every Llama-3.1-8B projection but the 14336-wide down projection (two rows, 512)."""
    if k >= 8192:
        return 2, 512, 4
    return 1, min(1024, max(64, 1 << (k - 1).bit_length())), 4


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) holding one row, weight (N, K) contiguous, bias (N,) or None -> (..., N)."""
    return torch.ops.eaglet.gemv(x, weight, bias)


@torch.library.custom_op("eaglet::gemv", mutates_args=())
def _gemv_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    n, k = weight.shape
    xr = x.reshape(k)
    if xr.stride(0) != 1:
        xr = xr.contiguous()
    y = torch.empty(n, dtype=x.dtype, device=x.device)
    bn, bk, warps = tiles(n, k)
    _kernel[(triton.cdiv(n, bn),)](xr, weight, bias if bias is not None else y, y, n, K=k, BN=bn, BK=bk,
                                   EVEN_K=k % bk == 0, HAS_BIAS=bias is not None, num_warps=warps)
    return y.view(*x.shape[:-1], n)


@_gemv_op.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


if triton is not None:
    @triton.jit
    def _kernel(X, W, B, Y, N, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                HAS_BIAS: tl.constexpr):
        rows = tl.program_id(0) * BN + tl.arange(0, BN)
        rm = rows < N
        acc = tl.zeros((BN, BK), dtype=tl.float32)
        for k0 in range(0, K, BK):
            cols = k0 + tl.arange(0, BK)
            if EVEN_K:
                w = tl.load(W + rows[:, None] * K + cols[None, :], mask=rm[:, None], other=0.0,
                            eviction_policy="evict_first")
                x = tl.load(X + cols)
            else:
                cm = cols < K
                w = tl.load(W + rows[:, None] * K + cols[None, :], mask=rm[:, None] & cm[None, :], other=0.0,
                            eviction_policy="evict_first")
                x = tl.load(X + cols, mask=cm, other=0.0)
            acc += w.to(tl.float32) * x[None, :].to(tl.float32)
        y = tl.sum(acc, 1)
        if HAS_BIAS:
            y += tl.load(B + rows, mask=rm, other=0.0).to(tl.float32)
        tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=rm)
