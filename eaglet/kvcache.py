"""The caches attention runs over, behind one interface (`Cache`), and the preallocated KV cache for a
batch of sequences (slots) with the operations speculation needs.

Every attention layer hands its cache the new tokens' rotated queries and their keys and values and
gets the attention output back (`attend`); how keys are kept and what a query sees is the cache's
business: the decoding cache (`KVCache`) stores them in slots and attends over the committed prefix
and the block the step's mask allows, a prefill of fresh rows (models/prefill.py) over its own
tokens, the frozen target in training (`Causal`) causally over the whole sequence, the training-time
test (`AppendKV`, train/ttt.py) across unrolled steps. A cache whose keys and values live in slots
that a kernel can write and read in place (`in_place`) also offers them per layer (`layer_kv`), so
the model can run the one-kernel path (models/cache_attention.py) over it.

In KVCache each row b has a committed length `lens[b]` on the device and its mirror `host_lens[b]`
on the host (so attention spans are known without a sync). A forward writes its T new tokens into
slots lens[b] .. lens[b]+T-1 (see AttnMeta) without committing them; the caller then commits all of
them (`advance`), only an accepted subset (`keep` of the slots `keep_slots` gives, the accepted path
of a tree, then `lens += count`), or rolls back (`truncate`).

Device-only operations (`keep`, `lens +=` inside a CUDA graph) leave the host mirror alone; the
caller brings it up to date with `commit_host` (counts it already has) or `sync_host` (a sync).
`view(lo, hi)` is a cache over rows lo..hi-1 sharing this one's storage (prefill of new requests
into free rows while other rows hold their sequences).
"""
from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from .models import exact
from .transfer import zero_rows


def keep_slots(lens: torch.Tensor, index: torch.Tensor, count: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Committing a verified block keeps, for each row b, the just-written tokens at block offsets
    index[b, :count[b]] (index (B, M), count (B,) <= M), in that order, at slots lens[b], lens[b]+1,
    ...; the rest are dropped. Returns the moves as (rows, src, dst), each (B, M), for KVCache.keep
    (entries past count copy onto themselves); the caller then adds count to lens. Graph-safe; a
    function of tensors, for compiled callers (spec/loop.py's settle)."""
    bsz, m = index.shape
    ar = torch.arange(m, device=index.device)[None, :]  # (1, M)
    src = lens[:, None] + torch.where(ar < count[:, None], index, ar)
    return torch.arange(bsz, device=index.device)[:, None].expand(bsz, m), src, lens[:, None] + ar


class Cache(Protocol):
    """What an attention layer asks of the cache it runs over."""

    in_place: bool  # keys and values live in slots a kernel reads and writes (layer_kv)

    def attend(self, layer: int, q: torch.Tensor, kv: torch.Tensor, meta) -> torch.Tensor:
        """Keep the new tokens' keys and values kv (B, T, 2, Hkv, D) and attend the rotated queries
        q (B, Hkv, G*T, D) (each kv head's G query heads stacked: head kv*G + g at row g*T + t) over
        what `meta` (AttnMeta, or None for a cache that needs none) lets each see: (B, H, T, D)."""

    def layer_kv(self, layer: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of rows 0..rows-1 of this layer, (rows, Hkv, S, D) each, for kernels that
        store and attend in place (only where `in_place`)."""


def attend_masked(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, meta) -> torch.Tensor:
    """q (B, Hkv, G*T, D) over keys and values (B, Hkv, S, D) with meta's mask: (B, H, T, D).
    Grouped-query attention as plain attention over the kv heads: each kv head's G query heads are
    G*T query rows (mask rows repeated), which the fused SDPA kernels accept with a mask."""
    b, hkv, gt, d = q.shape
    t = meta.slots.shape[1]
    if exact.applies(meta, t):
        return exact.attend_rows(q, keys, vals, meta)
    o = F.scaled_dot_product_attention(q, keys, vals, attn_mask=meta.bias(q.dtype, gt // t))  # (B, Hkv, G*T, D)
    return o.reshape(b, hkv * (gt // t), t, d)  # some SDPA backends return another layout


class KVCache:
    """The decoding cache: a row per sequence, its keys and values in slots 0..max_len-1.

    Layout: one tensor `kv` (layers, 2, batch, kv_heads, max_len, head_dim); `k` and `v` are its two
    halves, so a layer's view of each is directly what attention reads, and a forward writes a
    layer's new keys and values together, in one indexed store."""

    in_place = True
    absorbed = True  # MLA attends over these latents in the absorbed form (models/mla.py)

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, parts: int = 2):
        """parts: 2 (keys, values), or 1 for a latent cache (MLA: one entry a token and layer)."""
        self.kv = torch.zeros(num_layers, parts, batch, num_kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.k, self.v = self.kv[:, 0], self.kv[:, -1]  # (layers, batch, kv_heads, max_len, head_dim) each
        self.lens = torch.zeros(batch, dtype=torch.long, device=device)  # committed tokens per row
        self.host_lens = np.zeros(batch, dtype=np.int64)  # the same on the host
        self.max_len = max_len
        self.kv_limit: int | None = None  # a fixed attention span (set per step by graphed decoders)

    @staticmethod
    def for_model(config, batch: int, max_len: int, dtype: torch.dtype, device) -> "KVCache":
        if config.mla is not None:  # MLA's latent cache: kv_lora_rank + qk_rope_head_dim values a token and layer
            return KVCache(config.num_layers, batch, 1, max_len, config.mla.width, dtype, device, parts=1)
        return KVCache(config.num_layers, batch, config.num_kv_heads, max_len, config.head_dim, dtype, device)

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    def view(self, lo: int, hi: int) -> "KVCache":
        """Rows lo..hi-1 as a cache of their own; writes and commits land in this cache."""
        c = object.__new__(KVCache)
        c.kv, c.lens, c.host_lens = self.kv[:, :, lo:hi], self.lens[lo:hi], self.host_lens[lo:hi]
        c.k, c.v = c.kv[:, 0], c.kv[:, -1]
        c.max_len, c.kv_limit = self.max_len, None
        return c

    # ---- what attention asks (Cache) ----
    def append(self, layer: int, slots: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor) -> None:
        """Store new keys and values. slots: (B, T) cache indices; kv: (B, T, 2, Hkv, D), keys then
        values; rows: (B, T) the row index of each (AttnMeta builds it once per forward)."""
        self.kv[layer][:, rows, :, slots] = kv  # the indexed view is (B, T, 2, Hkv, D)

    def attend(self, layer: int, q: torch.Tensor, kv: torch.Tensor, meta) -> torch.Tensor:
        """Store the new tokens at meta.slots (uncommitted) and attend over this layer's first
        meta.kv_len slots as meta's mask allows."""
        self.append(layer, meta.slots, kv, meta.rows)
        b, n = meta.slots.shape[0], meta.kv_len
        return attend_masked(q, self.k[layer, :b, :, :n], self.v[layer, :b, :, :n], meta)

    def layer_kv(self, layer: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer, :rows], self.v[layer, :rows]

    def latent(self, layer: int, entry: torch.Tensor, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """A latent cache (MLA): store the new tokens' entries (B, T, W) at meta.slots; the layer's
        first meta.kv_len entries (B, S, W) and meta's mask as an additive bias (B, 1, T, S)."""
        self.append(layer, meta.slots, entry[:, :, None, None], meta.rows)
        return self.k[layer, :meta.slots.shape[0], 0, :meta.kv_len], meta.bias(entry.dtype, 1)

    def kv_len(self, new: int) -> int:
        """Cache slots a forward of `new` more tokens (pending ones included) must attend over."""
        if self.kv_limit is not None:
            return self.kv_limit
        return int(self.host_lens.max()) + new

    # ---- what a step asks: commit, keep, truncate, release ----
    def advance(self, n: list[int] | int | torch.Tensor) -> None:
        """Commit the first n[b] just-written tokens of each row (host ints preferred)."""
        n = np.full(self.batch, n) if isinstance(n, int) else np.asarray(
            n.tolist() if isinstance(n, torch.Tensor) else n, dtype=np.int64)  # sync: only when given a tensor
        self.lens += torch.from_numpy(n).to(self.lens.device)
        self.host_lens += n

    def keep(self, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's keys and values at slots src[b, j] of row rows[b, j] to slots dst[b, j]
        (all read before any is written; `keep_slots` gives the three)."""
        self.kv[:, :, rows, :, dst] = self.kv[:, :, rows, :, src]  # (B, M, L, 2, Hkv, D) gathered first

    def commit_host(self, counts: list[int] | np.ndarray) -> None:
        """Mirror on the host a device-side commit of counts[b] tokens per row."""
        self.host_lens += np.asarray(counts, dtype=np.int64)

    def sync_host(self) -> None:
        self.host_lens[:] = self.lens.tolist()  # sync: only outside the hot path (tests, tools)

    def truncate(self, lens: list[int] | torch.Tensor) -> None:
        """Roll rows back to `lens` tokens (never longer than now); later writes overwrite the rest."""
        want = np.asarray(lens.tolist() if isinstance(lens, torch.Tensor) else lens, dtype=np.int64)
        np.minimum(self.host_lens, want, out=self.host_lens)
        self.lens.copy_(torch.from_numpy(self.host_lens.copy()))

    def release(self, rows: list[int]) -> None:
        """Empty the given rows at once (their slots are free for new sequences)."""
        self.host_lens[rows] = 0
        zero_rows(self.lens, rows)

    def reset(self) -> None:
        """Empty every row."""
        self.truncate([0] * self.batch)


class Causal:
    """The cache of a forward that reads whole sequences from position 0 and keeps nothing (the
    frozen target in training): each layer attends causally over its own keys with SDPA's
    is_causal, which needs no mask tensor and runs FlashAttention on the GPU. Right padding is
    harmless: a real token never sees a later (padding) position."""

    in_place = False
    absorbed = False

    def latent(self, layer: int, entry: torch.Tensor, meta=None) -> tuple[torch.Tensor, torch.Tensor]:
        """MLA over the whole sequence: its own entries, causally."""
        t = entry.shape[1]
        return entry, torch.full((t, t), float("-inf"), dtype=entry.dtype, device=entry.device).triu(1)

    def attend(self, layer: int, q: torch.Tensor, kv: torch.Tensor, meta=None) -> torch.Tensor:
        b, t, _, hkv, d = kv.shape
        q = q.view(b, -1, t, d)  # (B, H, T, D)
        k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)  # (B, Hkv, T, D)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != hkv)


class AppendKV:
    """An autograd-friendly cache for training: every forward appends its keys and values (no
    in-place writes), and attends over all appended so far as meta's mask allows. Slots are implied
    by order: the n-th token appended sits at slot n."""

    in_place = False

    def __init__(self, num_layers: int):
        self.k: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self.v: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]

    def append(self, layer: int, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add kv (B, T, 2, Hkv, D); every key and value of the layer so far, (B, Hkv, S, D) each."""
        self.k[layer].append(kv[:, :, 0].transpose(1, 2))  # (B, Hkv, T, D)
        self.v[layer].append(kv[:, :, 1].transpose(1, 2))
        return torch.cat(self.k[layer], 2), torch.cat(self.v[layer], 2)

    def attend(self, layer: int, q: torch.Tensor, kv: torch.Tensor, meta) -> torch.Tensor:
        keys, vals = self.append(layer, kv)
        return attend_masked(q, keys[:, :, :meta.kv_len], vals[:, :, :meta.kv_len], meta)
