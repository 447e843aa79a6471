"""Per-forward attention metadata: where new tokens go in the cache and which slots each sees.

Built once per forward (not per layer) from the cache lengths and, for trees, a mask over the
uncommitted block. Everything is a tensor op, so the same code runs inside a CUDA graph.

The uncommitted block of sequence b starts at slot lens[b]. A forward may follow `pending` tokens
already written there by earlier forwards (a drafter's previous tree levels); its T new tokens go
to slots lens[b] + pending + t and see the committed prefix plus whatever `tree_mask` allows.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..kernels import EAGER, Kernels, fusable


@dataclass
class AttnMeta:
    slots: torch.Tensor  # (B, T) cache slot of each new token
    rows: torch.Tensor  # (B, T) the batch row of each new token (cache writes)
    kv_len: int  # cache slots attended over (S)
    # cache_attention applies: every slot before the block's first is visible, and among the new
    # tokens `block_mask` (B, T, pending + T) says what each sees of the `pending` entries before
    # them and of each other (None: causal, every pending entry visible); no sliding window
    fast: bool = False
    block_mask: torch.Tensor | None = None
    pending: int = 0
    kernels: Kernels = EAGER  # the model's: whether the mask arithmetic runs compiled
    _mask_args: tuple = field(default=(), repr=False)  # what `mask` is made from, when asked for
    _mask: torch.Tensor | None = field(default=None, repr=False)
    _bias: dict = field(default_factory=dict, repr=False)
    _visible: list | None = field(default=None, repr=False)  # models/exact.py's slots per row and token
    prompt_lens: list[int] | None = None  # an exact model's prefill: each row's prompt length (no padding seen)

    @property
    def mask(self) -> torch.Tensor:
        """(B, 1, T, S) bool: new token t may attend to cache slot s. Made on first use, once per
        forward: the cache-attention kernel never asks, so decode, draft and verify steps skip it."""
        if self._mask is None:
            self._mask = self.kernels.fuse(attention_mask)(*self._mask_args)
        return self._mask

    def bias(self, dtype: torch.dtype, groups: int) -> torch.Tensor:
        """The mask as SDPA's additive bias (0 or -inf) in `dtype`, each query row repeated for the
        `groups` query heads of a kv head: (B, 1, G*T, S). Made once per forward and shared by the
        layers; given the bool mask, SDPA converts it in every layer (three kernels each)."""
        key = (dtype, groups)
        if key not in self._bias:
            self._bias[key] = self.kernels.fuse(additive_bias)(self.mask, groups, dtype)
        return self._bias[key]

    @staticmethod
    def build(lens: torch.Tensor, positions: torch.Tensor, kv_len: int, tree_mask: torch.Tensor | None = None,
              pending: int = 0, sliding_window: int | None = None, kernels: Kernels = EAGER) -> "AttnMeta":
        """lens: (B,) committed cache lengths; positions: (B, T) rope positions of the new tokens;
        kv_len: how many cache slots to attend over (>= max(lens) + pending + T);
        tree_mask: (B, T, pending + T) bool, new token t sees block entry u (its ancestors and itself
        in a tree); None means causal over the new tokens and every pending entry visible;
        kernels: the model's (eaglet/kernels.py).
        """
        slots, rows = kernels.fuse(slots_and_rows)(lens, positions, pending)
        return AttnMeta(slots=slots, rows=rows, kv_len=kv_len, kernels=kernels,
                        fast=sliding_window is None, block_mask=tree_mask, pending=0 if tree_mask is None else pending,
                        _mask_args=(lens, positions, kv_len, tree_mask, pending, sliding_window))


@fusable
def slots_and_rows(lens: torch.Tensor, positions: torch.Tensor, pending: int) -> tuple[torch.Tensor, torch.Tensor]:
    """AttnMeta's slots (B, T) and rows (B, T): fused (on the GPU) into one kernel of the step."""
    bsz, t = positions.shape
    return (lens[:, None] + pending + torch.arange(t, device=positions.device),
            torch.arange(bsz, device=positions.device)[:, None].expand(bsz, t))


@fusable
def attention_mask(lens: torch.Tensor, positions: torch.Tensor, kv_len: int, tree_mask: torch.Tensor | None,
                   pending: int, sliding_window: int | None) -> torch.Tensor:
    """AttnMeta.mask: (B, 1, T, S) bool."""
    bsz, t = positions.shape
    u = pending + t
    dev = positions.device
    ar_t = torch.arange(t, device=dev)
    if tree_mask is None:
        tree_mask = (ar_t[:, None] + pending >= torch.arange(u, device=dev)[None, :]).expand(bsz, t, u)
    s = torch.arange(kv_len, device=dev)
    rel = s[None, :] - lens[:, None]  # (B, S) offset of slot s inside the uncommitted block
    in_block = (rel >= 0) & (rel < u)
    seen = tree_mask.gather(2, rel.clamp(0, u - 1)[:, None, :].expand(bsz, t, kv_len))  # (B, T, S)
    mask = (rel < 0)[:, None, :] | (in_block[:, None, :] & seen)
    if sliding_window is not None:  # trees are not combined with windows: block keys use their slot
        key_pos = torch.where((rel >= pending) & in_block,
                              positions.gather(1, (rel - pending).clamp(0, t - 1)), s[None, :])  # (B, S)
        mask = mask & ((positions[:, :, None] - key_pos[:, None, :]) < sliding_window)
    return mask[:, None]


@fusable
def additive_bias(mask: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (B, 1, T, S) as an additive bias (0 or -inf), rows repeated: (B, 1, G*T, S)."""
    m = mask if groups == 1 else mask.repeat(1, 1, groups, 1)
    return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(~m, float("-inf"))
