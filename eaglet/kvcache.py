"""Preallocated KV cache for a batch of sequences, with the operations speculation needs.

Layout: one tensor for K and one for V, each (layers, batch, kv_heads, max_len, head_dim), so a
layer's view is directly what attention reads. Each sequence b has a committed length `lens[b]`.
A forward writes its T new tokens into slots lens[b] .. lens[b]+T-1 (see AttnMeta) without
committing them; the caller then commits all of them (`advance`), only an accepted subset
(`keep`, the accepted path of a tree), or rolls back (`truncate`).
"""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lens = torch.zeros(batch, dtype=torch.long, device=device)  # committed tokens per sequence
        self.host_lens = [0] * batch  # the same on the host, so kv_len needs no sync
        self.max_len = max_len

    @staticmethod
    def for_model(config, batch: int, max_len: int, dtype: torch.dtype, device) -> "KVCache":
        return KVCache(config.num_layers, batch, config.num_kv_heads, max_len, config.head_dim, dtype, device)

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new keys/values. slots: (B, T) cache indices; k, v: (B, Hkv, T, D)."""
        b = torch.arange(slots.shape[0], device=slots.device)[:, None].expand_as(slots)  # (B, T)
        self.k[layer][b, :, slots] = k.transpose(1, 2)  # indexed view is (B, T, Hkv, D)
        self.v[layer][b, :, slots] = v.transpose(1, 2)

    def kv_len(self, new: int) -> int:
        """Cache slots a forward of `new` more tokens (pending ones included) must attend over."""
        return max(self.host_lens) + new

    @staticmethod
    def _host(n) -> list[int]:
        return n.tolist() if isinstance(n, torch.Tensor) else list(n)  # sync: only when given a tensor

    def update(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_len: int):
        """Write new keys/values, return this layer's first kv_len slots to attend over."""
        self.write(layer, slots, k, v)
        b = slots.shape[0]
        return self.k[layer, :b, :, :kv_len], self.v[layer, :b, :, :kv_len]

    def advance(self, n: list[int] | int | torch.Tensor) -> None:
        """Commit the first n[b] just-written tokens of each sequence (host ints preferred)."""
        n = [n] * self.batch if isinstance(n, int) else self._host(n)
        self.lens += torch.tensor(n, device=self.lens.device)
        self.host_lens = [a + b for a, b in zip(self.host_lens, n)]

    def keep(self, index: torch.Tensor, count: torch.Tensor, host_count: list[int] | None = None) -> None:
        """Commit, for each sequence b, the just-written tokens at block offsets index[b, :count[b]]
        (in that order), moving them to slots lens[b], lens[b]+1, ...; the rest are dropped.

        index: (B, M) offsets into the block written by the last forward, count: (B,) <= M.
        Entries of `index` past `count` are ignored. host_count: `count` on the host.
        """
        bsz, m = index.shape
        ar = torch.arange(m, device=index.device)[None, :]  # (1, M)
        src_off = torch.where(ar < count[:, None], index, ar)  # unused entries copy onto themselves
        src = self.lens[:, None] + src_off  # (B, M)
        dst = self.lens[:, None] + ar
        b = torch.arange(bsz, device=index.device)[:, None].expand_as(src)
        for t in (self.k, self.v):
            moved = t[:, b, :, src]  # (B, M, L, Hkv, D): gathered before any write
            t[:, b, :, dst] = moved
        self.lens += count
        host_count = self._host(count) if host_count is None else host_count
        self.host_lens = [a + c for a, c in zip(self.host_lens, host_count)]

    def truncate(self, lens: list[int] | torch.Tensor) -> None:
        """Roll sequences back to `lens` tokens (host ints, never longer than now); later writes
        overwrite the rest."""
        self.host_lens = [min(a, b) for a, b in zip(self.host_lens, self._host(lens))]
        self.lens.copy_(torch.tensor(self.host_lens, device=self.lens.device))

    def reset(self) -> None:
        """Empty every sequence."""
        self.truncate([0] * self.batch)


class AppendKV:
    """An autograd-friendly stand-in for KVCache in training: every forward appends its keys and
    values (no in-place writes), so the training-time test can attend across unrolled steps.
    Slots are implied by order: the n-th token appended sits at slot n."""

    def __init__(self, num_layers: int):
        self.k: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self.v: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]

    def update(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_len: int):
        self.k[layer].append(k)
        self.v[layer].append(v)
        return torch.cat(self.k[layer], 2)[:, :, :kv_len], torch.cat(self.v[layer], 2)[:, :, :kv_len]
