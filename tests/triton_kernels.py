"""What the Triton kernel tests share: the device they run on (the GPU, or the CPU through Triton's
interpreter, which conftest turns on without a GPU), skipping a module where neither can run, and
the kernels a model runs with one of them on."""
import os

import pytest
import torch

from eaglet.kernels import Kernels


def triton_device() -> str:
    """Call at module level: 'cuda' or 'cpu', or skip the module."""
    pytest.importorskip("triton")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1 (set by conftest)", allow_module_level=True)
    return dev


CACHE_ATTENTION = Kernels(cache_attention=True)
GEMV = Kernels(gemv=True)
TOPK = Kernels(topk=True)


def greedy_logits(model, cache, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """Feed `prompt` (B, T) into `cache`, then `steps - 1` greedy one-token steps: (steps, B, V) float
    logits of each forward's last token."""
    from eaglet.models.attention import AttnMeta

    ids, logits = prompt, []
    for _ in range(steps):
        t = ids.shape[1]
        pos = cache.lens[:, None] + torch.arange(t, device=ids.device)
        h, _ = model(ids, pos, cache, AttnMeta.build(cache.lens, pos, cache.kv_len(t), kernels=model.kernels))
        cache.advance(t)
        logits.append(model.logits(h[:, -1]).float())
        ids = logits[-1].argmax(-1, keepdim=True)
    return torch.stack(logits)
