"""Prefill of a batch of prompts of different lengths, shared by plain and speculative decoding:
right-padded into one forward, each row committing only its own tokens (the padding's K/V sits
past a row's length, where later writes overwrite it)."""
from __future__ import annotations

import torch

from ..kvcache import KVCache
from .attention import AttnMeta
from .llama import CausalLM


def prefill(model: CausalLM, cache: KVCache, prompts: list[list[int]],
            capture: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns the final hidden state at each prompt's last token (B, H) and, when `capture`
    names layers, their taps over the padded prompts (B, T, k*H)."""
    dev = cache.lens.device
    t = max(map(len, prompts))
    ids = torch.tensor([p + [0] * (t - len(p)) for p in prompts], device=dev)  # (B, T) right-padded
    positions = cache.lens[:, None] + torch.arange(t, device=dev)
    meta = AttnMeta.build(cache.lens, positions, cache.kv_len(t), sliding_window=model.config.sliding_window)
    hidden, taps = model(ids, positions, cache, meta, capture=capture)
    cache.advance([len(p) for p in prompts])
    last = torch.tensor([len(p) - 1 for p in prompts], device=dev)
    return hidden[torch.arange(len(prompts), device=dev), last], taps
