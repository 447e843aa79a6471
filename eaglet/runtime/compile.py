"""Where torch.compile is applied, and only there: on the GPU, the elementwise pieces of every
layer (RMSNorm with its fused residual add, RoPE on q and k, the MLP's gate-up / SiLU·mul / down)
each become one generated kernel instead of five to ten small ones. Matmuls and attention stay
cuBLAS and SDPA. Decoding at small batch is bound by kernel count, not bytes, so this is where
the time goes (BENCHMARKS.md has the measurement). Shapes are dynamic, so one compile serves
every batch size and token count; the CUDA graphs are captured around the compiled kernels."""
from __future__ import annotations

import torch
from torch import nn

from ..models.llama import MLP, RMSNorm, RoPE


def compile_kernels(model: nn.Module) -> int:
    """Compile the fusable modules of `model` in place (CUDA only); returns how many."""
    if next(model.parameters()).device.type != "cuda":
        return 0
    # one entry per (module code, specialization: size-1 dims, residual or not), shared by all layers
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    n = 0
    for m in model.modules():
        if isinstance(m, (RMSNorm, RoPE, MLP)):
            m.compile(dynamic=True, fullgraph=True)
            n += 1
    return n
