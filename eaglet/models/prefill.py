"""Prefill: prompts admitted into fresh rows of a cache, right-padded into one forward, shared by
plain and speculative decoding and graphed like every step (runtime/decoder.py).

A `PromptBatch` is the prompts as device tensors of a fixed shape, its length rounded up to a
bucket (`prompt_bucket`), so one captured graph serves every admission of that many prompts of
about that length; the decoder keeps one per shape as the graph's static input. The rows may be
any free rows of the cache: the forward attends only over its own tokens (a fresh row holds
nothing before them) and writes their keys and values into the named rows (`FreshRows`). The
padding's K/V lands past each row's length, where later writes overwrite it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import EAGER, Kernels
from ..kvcache import KVCache, attend_masked
from ..transfer import to_device
from . import exact
from .attention import AttnMeta
from .llama import CausalLM

MIN_BUCKET = 16


def prompt_bucket(n: int, cap: int) -> int:
    """The padded length of a prompt batch whose longest prompt has n tokens: a power of two
    (at least MIN_BUCKET), never past `cap` (the cache's length)."""
    return min(cap, max(MIN_BUCKET, 1 << (n - 1).bit_length()))


@dataclass
class PromptBatch:
    ids: torch.Tensor  # (b, T) right-padded prompt tokens
    lens: torch.Tensor  # (b,) prompt lengths
    rows: torch.Tensor  # (b,) the cache row each prompt goes to

    @staticmethod
    def alloc(b: int, t: int, device) -> "PromptBatch":
        z = lambda *s: torch.zeros(*s, dtype=torch.long, device=device)  # noqa: E731
        return PromptBatch(z(b, t), z(b), z(b))

    @staticmethod
    def of(prompts: list[list[int]], rows: list[int], device, t: int | None = None) -> "PromptBatch":
        t = t or max(map(len, prompts))
        return PromptBatch.alloc(len(prompts), t, device).fill(prompts, rows)

    def fill(self, prompts: list[list[int]], rows: list[int]) -> "PromptBatch":
        """Copy new prompts into these buffers (in place: a captured graph reads them)."""
        t = self.ids.shape[1]
        host = torch.zeros(len(prompts), t + 2, dtype=torch.long)
        for i, (p, r) in enumerate(zip(prompts, rows)):
            host[i, :len(p)] = torch.tensor(p)
            host[i, t], host[i, t + 1] = len(p), r
        host = to_device(host, torch.long, self.ids.device)  # one copy, no sync
        self.ids.copy_(host[:, :t])
        self.lens.copy_(host[:, t])
        self.rows.copy_(host[:, t + 1])
        return self


class FreshRows:
    """A cache as a prefill of empty rows sees it (the `Cache` interface): new keys and values are
    written into the given rows, and attention reads only those of this forward (the rows hold
    nothing before them)."""

    in_place = False

    def __init__(self, cache: KVCache, rows: torch.Tensor):
        self.cache, self.rows = cache, rows

    absorbed = False  # MLA expands the prompt's own latents (models/mla.py)

    def latent(self, layer: int, entry: torch.Tensor, meta: AttnMeta) -> tuple[torch.Tensor, torch.Tensor]:
        self.cache.append(layer, meta.slots, entry[:, :, None, None], self.rows[:, None].expand_as(meta.slots))
        return entry, meta.bias(entry.dtype, 1)

    def attend(self, layer: int, q: torch.Tensor, kv: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        self.cache.append(layer, meta.slots, kv, self.rows[:, None].expand_as(meta.slots))
        keys, vals = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
        if meta.prompt_lens is not None:
            return exact.attend_prompts(q, keys, vals, meta)
        return attend_masked(q, keys, vals, meta)  # (B, H, T, D)


def fresh_meta(b: int, t: int, device, sliding_window: int | None = None,
               kernels: Kernels = EAGER) -> tuple[torch.Tensor, AttnMeta]:
    """Positions (b, t) and causal attention metadata of a block starting at position 0."""
    positions = torch.arange(t, device=device).expand(b, t)
    return positions, AttnMeta.build(torch.zeros(b, dtype=torch.long, device=device), positions, t,
                                     sliding_window=sliding_window, kernels=kernels)


def prefill(model: CausalLM, cache: KVCache, batch: PromptBatch,
            capture: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Prefill fresh rows and commit the prompts (device lengths; the host mirror is the caller's).
    Returns the final hidden state at each prompt's last token (b, H) and, when `capture` names
    layers, their taps over the padded prompts (b, T, k*H)."""
    b, t = batch.ids.shape
    positions, meta = fresh_meta(b, t, batch.ids.device, model.config.sliding_window, model.kernels)
    if model.kernels.exact:  # each row attends over its own prompt alone, whatever the padding (models/exact.py)
        meta.prompt_lens = batch.lens.tolist()
    hidden, taps = model(batch.ids, positions, FreshRows(cache, batch.rows), meta, capture=capture)
    cache.lens.index_copy_(0, batch.rows, batch.lens)
    last = hidden.gather(1, (batch.lens - 1)[:, None, None].expand(b, 1, hidden.shape[-1]))[:, 0]
    return last, taps
