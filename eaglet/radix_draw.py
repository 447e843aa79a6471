"""The draw under a top-k / top-p cut for 16-bit logits, each row spread over many programs.

cut_draw.py's kernel finds the cut's threshold in one program a row, pass after pass over the row:
latency-bound, 160-750 µs a call on the H200 whatever the row count (one row, one SM busy). Here the
threshold comes from radix histograms instead, each pass split over many programs a row. For
bfloat16 and float16 logits a 16-bit key orders the entries as their values do (so as x / T does,
for any temperature T > 0), and two rounds of 256 bins find any threshold exactly:

1. counts and masses (exp(x/T - max/T)) per high byte of the key, per split of the row;
2. the bin holding the k-th largest key (top-k; no top-k: k = V), then the counts and masses of the
   low byte inside it: the k-th key exactly, and Z, the mass of the entries at or above it;
3. top-p keeps the entries with less than p * Z above them (an upper set: what is above a kept entry
   is kept): its bin from round 1's masses, then the low byte's masses inside it;
4. the draw: each split's best x / T + Gumbel noise among the keys at or above both thresholds, then the
   best split (the lowest index on ties, as argmax takes).

Every sum has a fixed order (no atomics), so a row's draw depends on that row alone and is the same
on every run. Equal logits share a key, so they are kept or cut together, as in cut_draw.py and the
sorted path. The same draw as cut_draw.py's kernel and as the sort (tests/test_cut_draw.py), but for
float near-ties in the nucleus mass, which each path sums in its own order.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without Triton
    triton = None

if triton is not None:
    from .cut_draw import chunk  # a chunk's x / T and Gumbel-noised scores, as cut_draw's kernel draws

CHUNK = 32  # entries a histogram step compares against the 256 bins: a (32, 256) tile, 64 values a thread
# Off in the package: served on an H100 with CHUNK 128 (a (128, 256) tile, 256 values a thread of 4 warps,
# beyond the registers) the mixed-settings load was no faster than with cut_draw's kernel (docs/notebook.md);
# bench/gpu/draw_ab.py times it beside cut_draw's kernel and the sort, to decide.
ON = False
SPAN = 1024  # entries a program: 48 programs a row of SmolLM2's 49,152, 126 of Llama 3's 128,256
BINS = 256


def takes(x: torch.Tensor) -> bool:
    """Whether this path draws from these logits: when ON, for 16-bit keys (bfloat16, float16)."""
    return ON and x.dtype in (torch.bfloat16, torch.float16)


def splits(v: int) -> int:
    """Programs a row: one per SPAN entries, whatever the row count, so that every sum a row's draw
    depends on has the same order alone and in any batch (a seeded request's text is the same)."""
    return triton.cdiv(v, SPAN)


def radix_draw(x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
               seeds: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """As cut_draw.cut_draw, for 16-bit logits: x (B, ..., V); temperature, top_k, top_p (B,); seeds
    (B, ...); ids (V,). Returns (B, ...) int64 draws (a greedy row's is not meaningful)."""
    v = x.shape[-1]
    rows = x.reshape(-1, v)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    r = rows.shape[0]
    per = r // x.shape[0]
    s, span = splits(v), SPAN
    sp2 = triton.next_power_of_2(s)
    seed = seeds.reshape(-1).contiguous()
    assert seed.numel() == r and ids.shape == (v,)
    dev = x.device
    top = rows.amax(-1).float()
    cnt = torch.empty(3, r, s, BINS, dtype=torch.int32, device=dev)  # rounds 1, 2 and 3's partials
    mass = torch.empty(3, r, s, BINS, dtype=torch.float32, device=dev)
    state = torch.empty(r, 4, dtype=torch.int32, device=dev)  # high bin of k-th key, k-th key, top-p bin, threshold
    target = torch.empty(r, dtype=torch.float32, device=dev)  # p * Z
    best = torch.empty(r, s, dtype=torch.float32, device=dev)
    at = torch.empty(r, s, dtype=torch.int64, device=dev)
    args = (rows, rows.stride(0), v, span, per, temperature, top_k, top_p, top)  # what every (row, split) kernel takes
    grid, one = (r, s), (r,)
    stride = r * s * BINS  # one round's partials
    hist_kernel[grid](*args, state, -1, cnt, mass, CHUNK=CHUNK)
    kth_bin_kernel[one](v, *args[4:8], s, cnt, state, SP2=sp2)
    hist_kernel[grid](*args, state, 0, cnt[1], mass[1], CHUNK=CHUNK)
    kth_key_kernel[one](v, *args[4:8], s, cnt, mass, stride, state, target, SP2=sp2)
    hist_kernel[grid](*args, state, 2, cnt[2], mass[2], CHUNK=CHUNK)
    threshold_kernel[one](v, *args[4:8], s, mass, stride, state, target, SP2=sp2)
    draw_kernel[grid](*args, state, seed, ids.contiguous(), best, at, CHUNK=CHUNK)
    out = torch.where(best == best.amax(-1, keepdim=True), at, v).amin(-1)
    return out.view(x.shape[:-1])


if triton is not None:
    @triton.jit
    def key16(x_ptr, offs, live):
        """Each entry's 16-bit ordered key as an int32 in [1, 65535] (larger x, larger key; -0 as +0)."""
        b = tl.load(x_ptr + offs, mask=live, other=float("-inf")).to(tl.int16, bitcast=True).to(tl.int32)
        k = tl.where(b >= 0, b, b ^ 0x7FFF)
        return tl.where(b == -32768, 0, k) + 32768

    @triton.jit
    def cuts(n, per, t_ptr, k_ptr, p_ptr, r):
        """Whether row r samples under a cut (else its threshold is 0: every key), and its top-k (n: none)."""
        k = tl.load(k_ptr + r // per).to(tl.int32)
        k = tl.where((k > 0) & (k < n), k, n)
        return (tl.load(t_ptr + r // per) != 0) & ((k < n) | (tl.load(p_ptr + r // per) < 1.0)), k

    @triton.jit
    def hist_kernel(x_ptr, stride, n, span, per, t_ptr, k_ptr, p_ptr, top_ptr, state_ptr, col, cnt_ptr, mass_ptr,
                    CHUNK: tl.constexpr):
        """Program (row, split): counts and masses of its entries per byte of their key: the high
        byte (col -1), or the low byte of those whose high byte is state[row, col]."""
        r = tl.program_id(0)
        sp = tl.program_id(1)
        t = tl.load(t_ptr + r // per)
        bins = tl.arange(0, 256)
        counts = tl.zeros((256,), tl.int32)
        masses = tl.zeros((256,), tl.float32)
        cut, _ = cuts(n, per, t_ptr, k_ptr, p_ptr, r)
        if cut:
            top = tl.load(top_ptr + r) / t
            sel = tl.load(state_ptr + r * 4 + tl.maximum(col, 0))
            x_ptr += r.to(tl.int64) * stride
            for start in range(sp * span, tl.minimum(sp * span + span, n), CHUNK):
                offs = start + tl.arange(0, CHUNK)
                live = offs < n
                key = key16(x_ptr, offs, live)
                e = tl.exp(tl.load(x_ptr + offs, mask=live, other=float("-inf")).to(tl.float32) / t - top)
                if col < 0:
                    b = key >> 8
                else:
                    b = key & 255
                    live = live & ((key >> 8) == sel)
                if tl.max(live.to(tl.int32), 0) > 0:  # the low byte's rounds: most chunks hold none of the bin
                    hit = (b[:, None] == bins[None, :]) & live[:, None]
                    counts += tl.sum(hit.to(tl.int32), 0)
                    masses += tl.sum(tl.where(hit, e[:, None], 0.0), 0)
        base = (r * tl.num_programs(1) + sp) * 256
        tl.store(cnt_ptr + base + bins, counts)
        tl.store(mass_ptr + base + bins, masses)

    @triton.jit
    def summed(ptr, r, s, SP2: tl.constexpr):
        """(256,) a row's partials summed over its s splits, in split order."""
        i = tl.arange(0, SP2)
        bins = tl.arange(0, 256)
        part = tl.load(ptr + (r * s + i[:, None]) * 256 + bins[None, :], mask=(i < s)[:, None], other=0)
        return tl.sum(part, 0)

    @triton.jit
    def crossing(c, k):
        """The bin (from the top) where the running count reaches k."""
        incl = tl.cumsum(c, 0, reverse=True)
        return tl.max(tl.where((incl >= k) & (incl - c < k), tl.arange(0, 256), -1), 0)

    @triton.jit
    def kth_bin_kernel(n, per, t_ptr, k_ptr, p_ptr, s, cnt_ptr, state_ptr, SP2: tl.constexpr):
        r = tl.program_id(0)
        cut, k = cuts(n, per, t_ptr, k_ptr, p_ptr, r)
        if cut:
            hi = crossing(summed(cnt_ptr, r, s, SP2), k)
            tl.store(state_ptr + r * 4, hi)

    @triton.jit
    def kth_key_kernel(n, per, t_ptr, k_ptr, p_ptr, s, cnt_ptr, mass_ptr, stride, state_ptr, target_ptr,
                       SP2: tl.constexpr):
        """The k-th largest key, the mass Z at or above it, and top-p's bin: the lowest whose mass above
        is under p * Z."""
        r = tl.program_id(0)
        cut, k = cuts(n, per, t_ptr, k_ptr, p_ptr, r)
        if cut:
            bins = tl.arange(0, 256)
            p = tl.load(p_ptr + r // per)
            hi = tl.load(state_ptr + r * 4)
            c1 = summed(cnt_ptr, r, s, SP2)
            m1 = summed(mass_ptr, r, s, SP2)
            above = tl.sum(tl.where(bins > hi, c1, 0), 0)
            lo = crossing(summed(cnt_ptr + stride, r, s, SP2), k - above)
            m2 = summed(mass_ptr + stride, r, s, SP2)
            z = tl.sum(tl.where(bins > hi, m1, 0.0), 0) + tl.sum(tl.where(bins >= lo, m2, 0.0), 0)
            goal = tl.where(p < 1.0, p * z, float("inf"))
            m_above = tl.cumsum(m1, 0, reverse=True) - m1
            tl.store(state_ptr + r * 4 + 1, hi * 256 + lo)
            tl.store(state_ptr + r * 4 + 2, tl.min(tl.where(m_above < goal, bins, 255), 0))
            tl.store(target_ptr + r, goal)

    @triton.jit
    def threshold_kernel(n, per, t_ptr, k_ptr, p_ptr, s, mass_ptr, stride, state_ptr, target_ptr,
                         SP2: tl.constexpr):
        """Top-p's key inside its bin; the row's threshold, the higher of top-k's and top-p's (0, every
        key, for a row without a cut)."""
        r = tl.program_id(0)
        cut, _ = cuts(n, per, t_ptr, k_ptr, p_ptr, r)
        tl.store(state_ptr + r * 4 + 3, 0)
        if cut:
            bins = tl.arange(0, 256)
            hi = tl.load(state_ptr + r * 4 + 2)
            goal = tl.load(target_ptr + r)
            m1 = summed(mass_ptr, r, s, SP2)
            m3 = summed(mass_ptr + 2 * stride, r, s, SP2)
            m_above = tl.sum(tl.where(bins > hi, m1, 0.0), 0) + tl.cumsum(m3, 0, reverse=True) - m3
            lo = tl.min(tl.where(m_above < goal, bins, 255), 0)
            tl.store(state_ptr + r * 4 + 3, tl.maximum(tl.load(state_ptr + r * 4 + 1), hi * 256 + lo))

    @triton.jit
    def draw_kernel(x_ptr, stride, n, span, per, t_ptr, k_ptr, p_ptr, top_ptr, state_ptr, seed_ptr, ids_ptr, best_ptr, at_ptr,
                    CHUNK: tl.constexpr):
        """Program (row, split): its best x / T + Gumbel noise (sampling.gumbel_noised) among the keys at
        or above the row's threshold, and where (the lowest index on ties)."""
        r = tl.program_id(0)
        sp = tl.program_id(1)
        t = tl.load(t_ptr + r // per)
        best = tl.full((), -float("inf"), tl.float32)
        at = tl.full((), 0, tl.int64)
        if t != 0:
            floor = tl.load(state_ptr + r * 4 + 3)
            seed = tl.load(seed_ptr + r)
            x_ptr += r.to(tl.int64) * stride
            for start in range(sp * span, tl.minimum(sp * span + span, n), CHUNK):
                offs, live, _, _, score = chunk(x_ptr, ids_ptr, start, n, t, seed, CHUNK)
                score = tl.where(live & (key16(x_ptr, offs, live) >= floor), score, -float("inf"))
                m = tl.max(score, 0)
                i = tl.min(tl.where(score == m, offs, n), 0)
                take = m > best
                at = tl.where(take, i.to(tl.int64), at)
                best = tl.maximum(best, m)
        tl.store(best_ptr + r * tl.num_programs(1) + sp, best)
        tl.store(at_ptr + r * tl.num_programs(1) + sp, at)
