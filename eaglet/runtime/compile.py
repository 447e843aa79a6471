"""Where torch.compile is applied, and only there (on the GPU):

- modules: the elementwise pieces of every layer (RMSNorm with its fused residual add, RoPE with
  the grouped-query relayout, the MLP's gate-up / SiLU·mul / down) each become one generated kernel
  instead of five to ten small ones.
- attention of a few new tokens per row over the cache (decoding, drafting, verify): one Triton
  kernel that rotates q and k (RoPE), stores the new keys and values, attends and lays out the
  output (models/cache_attention.py) instead of RoPE, an indexed store, a relayout, a mask, SDPA
  and a copy.
- matmuls of up to 16 rows (decoding, drafting, verify): Triton kernels (models/gemv.py), faster
  than cuBLAS at streaming the weights, the MLP's gate-up with its SiLU·mul in the same kernel;
  longer inputs and `EAGLET_GEMV=0` keep cuBLAS.
- the top-k of each row that a draft tree takes at every level: one Triton kernel with the
  log-softmax (spec/topk.py) instead of a softmax and torch.topk's radix passes.
- functions marked `@fusable`: the index arithmetic around the model (attention masks, greedy
  acceptance), dozens of tiny kernels per speculation step each, become a few.

Decoding at small batch is bound by kernel count, not bytes, so this is where the time goes
(BENCHMARKS.md has the measurements). Shapes are dynamic, so one compile serves every batch size
and token count; the CUDA graphs are captured around the compiled kernels. On the CPU, or with
`--no-compile`, everything runs as written.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

_functions_on = False  # set once a model is compiled for the GPU


def fusable(fn):
    """Run `fn` (a pure function of tensors, lists of tensors and ints) compiled when its first
    argument (a list's first tensor) is on the GPU and compilation is on; as written otherwise."""
    compiled = None

    @functools.wraps(fn)
    def run(*args, **kwargs):
        nonlocal compiled
        first = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
        if _functions_on and first.is_cuda:
            if compiled is None:
                compiled = torch.compile(fn, dynamic=True, fullgraph=True)
            return compiled(*args, **kwargs)
        return fn(*args, **kwargs)
    return run


def enable_functions(on: bool = True) -> None:
    global _functions_on
    _functions_on = on


def compile_kernels(model: nn.Module) -> int:
    """Compile the fusable modules of `model` in place (CUDA only) and turn `@fusable` functions on;
    returns how many modules."""
    from ..models.llama import MLP, RMSNorm, RoPE

    if next(model.parameters()).device.type != "cuda":
        return 0
    # one entry per (module code, specialization: size-1 dims, residual or not), shared by all layers
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    enable_functions()
    from ..models import cache_attention
    # their bfloat16 dot products need Ampere or newer; older GPUs keep SDPA and cuBLAS
    ampere = torch.cuda.get_device_capability(next(model.parameters()).device)[0] >= 8
    cache_attention.enable(ampere)
    from ..models import gemv
    gemv.enable(ampere)
    from ..spec import topk
    topk.enable()
    n = 0
    for m in model.modules():
        if isinstance(m, (RMSNorm, RoPE, MLP)):
            m.compile(dynamic=True, fullgraph=True)
            n += 1
    return n
