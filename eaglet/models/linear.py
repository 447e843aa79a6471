"""Every linear layer of the models goes through `linear`, so the matmul can be chosen per device.

On the GPU, where the model's Kernels.gemv is on, up to 16 rows (decoding, drafting, verify) go to
models/gemv.py's Triton kernels, which stream the weights faster than cuBLAS
(bench/gpu/layer_probe.py), and longer inputs to F.linear.
On the CPU, which of W @ xᵀ and F.linear's x @ Wᵀ streams the weights of a decode or verify step's
few rows faster depends on the host (bench/cpu/matmul_probe.py: W @ xᵀ 1.5x for one row, 2.3x for two,
1.4x at 64 on one host; F.linear 1.9x for one row on another), so `cpu_wxt` times both once a process. With
W @ xᵀ one row is doubled, because W @ x for a single column is the slow GEMV again. Longer inputs
(prefill) keep F.linear. Exact models (Kernels.exact), whose rows must come out alike at any row count,
always take W @ xᵀ, in pieces of 64 rows. On the GPU an exact model's
matmuls, at every row count, take gemv.py's row-invariant kernel (cuBLAS picks its tiles and split-K
by the row count).
"""
from __future__ import annotations

import functools
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InvalidInput
from ..kernels import EAGER, Kernels
from . import gemv

CPU_MAX_ROWS = 64  # measured: where W @ xᵀ leads F.linear on the CPU, it leads up to here
CPU_MATMUL = "EAGLET_CPU_MATMUL"  # wxt or linear: the few-row matmul on the CPU, not timed (auto: timed)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           kernels: Kernels = EAGER) -> torch.Tensor:
    """x (..., K) @ weight (N, K)ᵀ + bias -> (..., N)."""
    k = x.shape[-1]
    rows = x.numel() // k
    if kernels.exact and exact_on_gpu(x, weight):
        return gemv.exact(x, weight, bias)
    if kernels.gemv and gemv.usable(x, weight, rows):
        return gemv.gemv(x, weight, bias)
    if weight.device.type != "cpu":
        return F.linear(x, weight, bias)
    if rows > CPU_MAX_ROWS and kernels.exact:  # W @ xᵀ reduces a row alike at 1 to 64 rows: in pieces of 64
        return torch.cat([linear(part, weight, bias, kernels) for part in x.reshape(rows, k).split(CPU_MAX_ROWS)]
                         ).view(*x.shape[:-1], weight.shape[0])
    if rows > CPU_MAX_ROWS or rows == 0 or not (kernels.exact or cpu_wxt()):
        return F.linear(x, weight, bias)
    x2 = x.reshape(rows, k)
    if rows == 1:
        x2 = torch.cat([x2, x2])
    y = (weight @ x2.t()).t()[:rows].contiguous()  # (rows, N)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], weight.shape[0])


@functools.cache
def cpu_wxt() -> bool:
    """Whether this CPU's few-row matmuls take W @ xᵀ (else F.linear): both timed once a process on 1 and
    16 rows of 24 distinct weights (85 MB, beyond the caches, as a forward streams them; about 0.2 s),
    the faster over both row counts, the best of 3 interleaved rounds. EAGLET_CPU_MATMUL=wxt or linear
    decides without timing."""
    forced = os.environ.get(CPU_MATMUL, "auto")
    if forced not in ("auto", "wxt", "linear"):
        raise InvalidInput(f"{CPU_MATMUL}={forced!r}: choose wxt, linear or auto")
    if forced != "auto":
        return forced == "wxt"
    weights = [torch.full((1536, 576), 0.5) for _ in range(24)]
    xs = {rows: torch.full((rows, 576), 0.25) for rows in (1, 2, 16)}
    ways = {"wxt": lambda x, w: w @ x.t(), "linear": F.linear}
    best = {name: float("inf") for name in ways}
    with torch.no_grad():
        for _ in range(3):
            for name, fn in ways.items():
                t0 = time.perf_counter()
                for rows in (1, 16):
                    x = xs[2] if name == "wxt" and rows == 1 else xs[rows]  # one row doubled, as `linear` does
                    for w in weights:
                        fn(x, w)
                best[name] = min(best[name], time.perf_counter() - t0)
    return best["wxt"] < best["linear"]


def cpu_matmul() -> str | None:
    """The CPU's few-row matmul, where this process has chosen it (for records): wxt or linear."""
    return ("wxt" if cpu_wxt() else "linear") if cpu_wxt.cache_info().currsize else None


def exact_on_gpu(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether an exact model's matmul takes the row-invariant Triton kernel (models/gemv.py `exact`):
    on the GPU, float16 and bfloat16, without autograd."""
    return (gemv.triton is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and weight.is_contiguous() and not torch.is_grad_enabled() and x.numel() > 0)


class Linear(nn.Linear):
    """nn.Linear (same parameters and state-dict names) whose forward is `linear` with the model's
    kernels."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, kernels: Kernels = EAGER):
        super().__init__(in_features, out_features, bias=bias)
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.kernels)
