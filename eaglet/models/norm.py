"""RMSNorm's arithmetic, in one place: the RMSNorm module (models/llama.py), `linear`'s unfused path
for a normed input, and the few-row kernels (models/gemv.py) all round as this does."""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / rms(x)) with the statistics in float32 and x's dtype rounded before the weight."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)
