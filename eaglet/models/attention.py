"""Per-forward attention metadata: where new tokens go in the cache and which slots each sees.

Built once per forward (not per layer) from the cache lengths and, for tree verification, a tree
mask over the new tokens. Everything is a tensor op, so the same code runs inside a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttnMeta:
    slots: torch.Tensor  # (B, T) cache slot of each new token
    mask: torch.Tensor  # (B, 1, T, S) bool: new token t may attend to cache slot s

    @staticmethod
    def build(lens: torch.Tensor, positions: torch.Tensor, kv_len: int,
              tree_mask: torch.Tensor | None = None, sliding_window: int | None = None) -> "AttnMeta":
        """lens: (B,) committed cache lengths; positions: (B, T) rope positions of the new tokens;
        kv_len: how many cache slots to attend over (>= max(lens) + T);
        tree_mask: (B, T, T) bool, token t sees new token u (itself and its ancestors); causal if None.
        """
        bsz, t = positions.shape
        dev = positions.device
        ar_t = torch.arange(t, device=dev)
        slots = lens[:, None] + ar_t  # (B, T)
        s = torch.arange(kv_len, device=dev)
        rel = s[None, :] - lens[:, None]  # (B, S) offset of slot s inside the new block
        in_block = (rel >= 0) & (rel < t)
        if tree_mask is None:
            tree_mask = (ar_t[:, None] >= ar_t[None, :]).expand(bsz, t, t)
        seen_new = tree_mask.gather(2, rel.clamp(0, t - 1)[:, None, :].expand(bsz, t, kv_len))  # (B, T, S)
        mask = (rel < 0)[:, None, :] | (in_block[:, None, :] & seen_new)
        if sliding_window is not None:
            key_pos = torch.where(in_block, positions.gather(1, rel.clamp(0, t - 1)), s[None, :])  # (B, S)
            mask &= (positions[:, :, None] - key_pos[:, None, :]) < sliding_window
        return AttnMeta(slots=slots, mask=mask[:, None])
