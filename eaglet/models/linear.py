"""Every linear layer of the models goes through `linear`, so the matmul can be chosen per device.

On the GPU, where the model's Kernels.gemv is on, up to 16 rows (decoding, drafting, verify) go to
models/gemv.py's Triton kernels, which stream the weights faster than cuBLAS
(bench/gpu/layer_probe.py), and longer inputs to F.linear.
On the CPU, for the few rows of a decode or verify step, MKL streams the weights faster as W @ xᵀ
than as F.linear's x @ Wᵀ
(bench/cpu/matmul_probe.py, record bench/results/matmul-probe-cpu-*.json: 1.5x for one row,
2.3x for two, still 1.4x at 64), and one row is doubled because W @ x for a single column is the slow
GEMV again. Longer inputs (prefill) keep F.linear, but for exact models (Kernels.exact), whose rows
must come out alike at any row count: they go in pieces of 64 rows. On the GPU an exact model's
matmuls, at every row count, take gemv.py's row-invariant kernel (cuBLAS picks its tiles and split-K
by the row count).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import EAGER, Kernels
from . import gemv

CPU_MAX_ROWS = 64  # measured: W @ xᵀ leads F.linear up to here on the CPU


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
    if rows > CPU_MAX_ROWS or rows == 0:
        return F.linear(x, weight, bias)
    x2 = x.reshape(rows, k)
    if rows == 1:
        x2 = torch.cat([x2, x2])
    y = (weight @ x2.t()).t()[:rows].contiguous()  # (rows, N)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], weight.shape[0])


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
