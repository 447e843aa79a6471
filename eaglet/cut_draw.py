"""A sampled row's draw under its top-k / top-p cut, as one Triton kernel that never sorts the vocabulary.

A row's draw is argmax(x + g) over the tokens its cut keeps (sampling.RowSampling.pick: x its logits
over its temperature, g Gumbel noise hashed from its stream key, position and token id). Both cuts
keep an upper set of x: top-k the tokens with fewer than k others above them, top-p those whose
probability above them (strictly larger x, among the top-k) is less than p. So the draw needs no
sorted order, only a threshold, and the threshold need not be found in full:

- top-k: the k-th largest logit by a radix select over its bits (a 256-bin histogram a pass, one
  pass a byte that the dtype uses: two for bfloat16); dividing by the temperature keeps the order, so
  the k-th largest x is the k-th largest logit over t;
- top-p: the draw over the tokens at or above the top-k threshold is the answer if the mass above it is
  under p; if not, the cut lies above it, and the next candidate is the draw over the tokens above
  it. Each pass checks one candidate and finds the next, and the draw usually lands inside the
  nucleus: one or two passes. The largest x is always kept (nothing lies above it), so the loop ends.

A full sort of the vocabulary, with the softmax, cumulative sum, masks and scatter around it, cost a
sampled step about 0.25 ms over 16 rows of SmolLM2 on the H200 (BENCHMARKS.md, Serving). One program a
row reads its row a few times, from L2, in chunks; each lane keeps its own running best and sums
across the chunks and the lanes are reduced once a pass (a reduction is a block-wide barrier: once a
chunk they were most of a pass's time); each row's result depends on that row alone,
the same at any row count (what --exact asks of the step's kernels). It takes calls of MIN_ROWS rows
or more, where it measured faster than the sort at every setting.

Ties: tokens of equal x are kept or cut together (sorting would split them in its own order);
`sampling.RowSampling.scaled`, the torch path, cuts the same way. Used where a model's
`Kernels.draw` is on (eaglet/kernels.py: the GPU); under TRITON_INTERPRET=1 (the CPU tests) on any device.
"""
from __future__ import annotations

import torch

from .models.cache_attention import INTERPRET

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without Triton
    triton = None

BLOCK, WARPS = 4096, 16  # entries a chunk (a row is read in chunks, every pass) and warps a program
# H100, SmolLM2's 49,152 entries, graphed (bench/gpu/draw_ab.py, draw-ab-gpu-20261206-004011.json; the
# tile of least total time of five, `--pick`): kernel / sort for top-p 0.9, top-k 50, both: 1 row 114 /
# 317, 157 / 340, 183 / 340 µs; 16 rows 150 / 506, 158 / 512, 209 / 512; a 16-node tree of 16 rows 217 /
# 2473, 250 / 2440, 327 / 2442. Faster than the sort at every row count measured, so from one row.
MIN_ROWS = 1
LEVELS = {torch.bfloat16: 2, torch.float16: 3, torch.float32: 4}  # radix passes: the float32 bytes a dtype sets


def usable(x: torch.Tensor) -> bool:
    """Whether the kernel takes these logits (callers ask only where Kernels.draw is on): at least
    MIN_ROWS rows (positions) of them."""
    return (triton is not None and (x.is_cuda or INTERPRET) and x.dtype in LEVELS and x.shape[-1] < (1 << 31)
            and x.numel() >= MIN_ROWS * x.shape[-1])


def cut_draw(x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
             seeds: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """x (B, ..., V) logits; temperature, top_k, top_p (B,) each row's settings (temperature 0: the
    row's result is not computed, 0 is stored); seeds (B, ...) the noise key of each position; ids
    (V,) each entry's hashed token id. Returns (B, ...) int64: each position's draw, argmax(x / T + g)
    over what its row's top-k and top-p keep."""
    v = x.shape[-1]
    rows = x.reshape(-1, v)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    per = rows.shape[0] // x.shape[0]  # positions a row of settings covers
    seed = seeds.reshape(-1).contiguous()
    assert seed.numel() == rows.shape[0] and ids.shape == (v,)
    out = torch.empty(rows.shape[0], dtype=torch.long, device=x.device)
    cut_draw_kernel[(rows.shape[0],)](rows, rows.stride(0), v, per, temperature, top_k, top_p, seed,
                                      ids.contiguous(), out, LEVELS=LEVELS[x.dtype], BLOCK=BLOCK,
                                      num_warps=WARPS)
    return out.view(x.shape[:-1])


if triton is not None:
    @triton.jit
    def mix32(x):
        x = ((x >> 16) ^ x) * 0x45D9F3B & 0xFFFFFFFF
        x = ((x >> 16) ^ x) * 0x45D9F3B & 0xFFFFFFFF
        return (x >> 16) ^ x

    @triton.jit
    def ordered_key(x):
        """x's float32 bits as an int32 that orders like x (larger x, larger key)."""
        bits = x.to(tl.int32, bitcast=True)
        return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)

    @triton.jit
    def chunk(x_ptr, ids_ptr, start, n, t, seed, BLOCK: tl.constexpr):
        """Entries start..start+BLOCK of the row: their indices, which are live, x / t, its ordered
        32-bit key (larger x, larger key) and x / t plus the row's Gumbel noise (sampling.gumbel_noised)."""
        offs = start + tl.arange(0, BLOCK)
        live = offs < n
        x = tl.load(x_ptr + offs, mask=live, other=-float("inf")).to(tl.float32) / t
        key = ordered_key(x)
        u = mix32(seed ^ tl.load(ids_ptr + offs, mask=live, other=0))
        u = ((u >> 9).to(tl.float32) + 0.5) / 8388608.0  # as sampling.gumbel_noised: inside (0, 1)
        return offs, live, x, key, x - tl.log(-tl.log(u))

    @triton.jit
    def lanes_best(best, at, key, n, floor):
        """The row's draw from the lanes' running bests: the largest score, at the lowest index
        holding it (each lane keeps its first, the chunks ascending), and that entry's key."""
        m = tl.max(best, 0)
        i = tl.min(tl.where(best == m, at, n), 0)
        return i, tl.max(tl.where((best == m) & (at == i), key, floor), 0)

    @triton.jit
    def best_above(x_ptr, ids_ptr, n, t, seed, floor, BLOCK: tl.constexpr):
        """The draw among entries whose key is at least `floor`: (index, its key); and the row's max x."""
        best = tl.full((BLOCK,), -float("inf"), tl.float32)
        top = tl.full((BLOCK,), -float("inf"), tl.float32)
        at = tl.zeros((BLOCK,), tl.int32)
        at_key = tl.zeros((BLOCK,), tl.int32)
        for start in range(0, n, BLOCK):
            offs, live, x, key, score = chunk(x_ptr, ids_ptr, start, n, t, seed, BLOCK)
            top = tl.maximum(top, x)
            score = tl.where(live & (key >= floor), score, -float("inf"))
            take = score > best  # an earlier chunk keeps a tie
            best = tl.where(take, score, best)
            at = tl.where(take, offs, at)
            at_key = tl.where(take, key, at_key)
        i, i_key = lanes_best(best, at, at_key, n, floor)
        return i, i_key, tl.max(top, 0)

    @triton.jit
    def kth_value(x_ptr, n, k, LEVELS: tl.constexpr, BLOCK: tl.constexpr):
        """The k-th largest entry of the row (1 <= k <= n), by a radix select over its float32 bits as
        an unsigned key that orders like them: one pass a byte, most significant first, each counting
        the entries that match the bytes found so far into 256 bins by their next byte; LEVELS bytes
        (the ones the dtype sets: the rest are all 0s, or all 1s for a negative value)."""
        bins = tl.arange(0, 256)
        prefix = tl.zeros((), tl.int32)  # the key's bytes found so far
        above = tl.zeros((), tl.int32)  # entries whose key is larger than any that matches them
        for level in tl.static_range(LEVELS):
            hist = tl.zeros((256,), tl.int32)
            missed = tl.zeros((BLOCK,), tl.int32)
            for start in range(0, n, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                live = offs < n
                x = tl.load(x_ptr + offs, mask=live, other=0.0).to(tl.float32)
                key = ordered_key(x).to(tl.uint32, bitcast=True) ^ 0x80000000
                if level == 0:
                    match = live
                else:
                    match = live & ((key >> (32 - 8 * level)).to(tl.int32) == prefix)
                digit = tl.where(match, (key >> (24 - 8 * level)) & 0xFF, 0).to(tl.int32)
                hist += tl.histogram(digit, 256)
                missed += tl.where(match, 0, 1)
            hist -= tl.where(bins == 0, tl.sum(missed, 0), 0)  # the unmatched entries went to bin 0
            at_least = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # matching entries with this byte or larger
            d = tl.max(tl.where(above + at_least >= k, bins, 0), 0)
            above += tl.sum(tl.where(bins > d, hist, 0), 0)
            prefix = (prefix << 8) | d
        low = 32 - 8 * LEVELS
        key = prefix << low  # the unsigned key's bytes, back to the float's bits (low bits 1s if negative)
        if LEVELS < 4:
            key = tl.where(prefix < (1 << (8 * LEVELS - 1)), key | ((1 << low) - 1), key)
        bits = (key.to(tl.uint32, bitcast=True) ^ 0x80000000).to(tl.int32, bitcast=True)
        bits = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def cut_draw_kernel(x_ptr, stride, n, per, t_ptr, k_ptr, p_ptr, seed_ptr, ids_ptr, out_ptr,
                        LEVELS: tl.constexpr, BLOCK: tl.constexpr):
        r = tl.program_id(0)
        t = tl.load(t_ptr + r // per)
        at = tl.full((), 0, tl.int32)  # a greedy row (t 0) stores 0: the caller takes its argmax
        if t != 0:
            k = tl.load(k_ptr + r // per)
            p = tl.load(p_ptr + r // per)
            seed = tl.load(seed_ptr + r)
            x_ptr += r.to(tl.int64) * stride
            floor = tl.full((), -2147483648, tl.int32)  # every key
            if (k > 0) & (k < n):  # x / t keeps the logits' order: its k-th largest is theirs over t
                floor = ordered_key(kth_value(x_ptr, n, k, LEVELS, BLOCK) / t)
            at, at_key, top = best_above(x_ptr, ids_ptr, n, t, seed, floor, BLOCK)
            done = (p >= 1.0).to(tl.int32)
            while done == 0:
                # is the candidate in the nucleus? the mass above it against p of the mass at or above
                # the floor; and, in the same pass, the next candidate: the draw among the entries above it
                above = tl.zeros((BLOCK,), tl.float32)
                kept = tl.zeros((BLOCK,), tl.float32)
                best = tl.full((BLOCK,), -float("inf"), tl.float32)
                nxt = tl.zeros((BLOCK,), tl.int32)
                nxt_key = tl.zeros((BLOCK,), tl.int32)
                for start in range(0, n, BLOCK):
                    offs, live, x, key, score = chunk(x_ptr, ids_ptr, start, n, t, seed, BLOCK)
                    e = tl.where(live & (key >= floor), tl.exp(x - top), 0.0)
                    kept += e
                    above += tl.where(key > at_key, e, 0.0)
                    score = tl.where(live & (key > at_key), score, -float("inf"))
                    take = score > best
                    best = tl.where(take, score, best)
                    nxt = tl.where(take, offs, nxt)
                    nxt_key = tl.where(take, key, nxt_key)
                above_sum = tl.sum(above, 0)
                # nothing above: the largest x, always kept (so the loop ends)
                done = ((above_sum < p * tl.sum(kept, 0)) | (above_sum == 0.0)).to(tl.int32)
                if done == 0:
                    at, at_key = lanes_best(best, nxt, nxt_key, n, floor)
        tl.store(out_ptr + r, at.to(tl.int64))
