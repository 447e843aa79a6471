"""A sampled row's draw under its top-k / top-p cut, in Triton kernels that never sort the vocabulary.

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

Two ways to run the passes; each row's result depends on that row alone, the same at any row count
(what --exact asks of the step's kernels), and both give the same draws:
- over slices (calls of up to SPLIT_ROWS rows): a pass is a launch over (rows, slices of SLICE
  entries), so a few rows still fill the GPU (one program a row leaves 16 rows on 16 of 132 SMs, each
  pass compute-bound there: a hash and two logarithms an entry). A program writes its slice's partial
  (a histogram; the best score, its index and key; the row's max; masses) and the next launch combines
  the row's partials in slice order; the slices follow the vocabulary alone. ROUNDS nucleus checks
  run as launches; a row still undecided after them (rare) finishes its walk in one program.
- one program a row (larger calls): it reads its row a few times, from L2, in chunks; each lane keeps
  its own running best and sums across the chunks, reduced once a pass (a reduction is a block-wide
  barrier: once a chunk they were most of a pass's time).

A full sort of the vocabulary, with the softmax, cumulative sum, masks and scatter around it, cost a
sampled step about 0.25 ms over 16 rows of SmolLM2 on the H200 (BENCHMARKS.md, Serving).

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

BLOCK, WARPS = 4096, 16  # one program a row: entries a chunk (a row is read in chunks, every pass), warps
SLICE, SLICE_WARPS, ROUNDS = 2048, 4, 2  # over slices: entries and warps a program, nucleus checks launched
# H200, SmolLM2's 49,152 entries, graphed (bench/gpu/draw_ab.py, draw-ab-gpu-20261206-023042.json;
# slices of 2,048 x 4 warps, `--pick`'s choice of six tiles), µs for top-p 0.9 / top-k 50 / both: over
# slices 85 / 90 / 92 at one row, 90 / 97 / 103 at 16, 94 / 99 / 103 for a 16-node tree, 116 / 141 / 159
# at 64 rows and 241 / 322 / 397 for 16 trees of 16 nodes; one program a row 105 / 155 / 177, 116 / 157 /
# 178, 139 / 157 / 180, 138 / 157 / 200 and 215 / 251 / 319; the sort 312-335, 495-503, 496-502, 767-774
# and 2142-2159. So slices up to 64 rows, one program a row above, the kernels from one row.
MIN_ROWS = 1
SPLIT, SPLIT_ROWS = True, 64  # the passes over slices, for calls of up to SPLIT_ROWS rows (positions)
LEVELS = {torch.bfloat16: 2, torch.float16: 3, torch.float32: 4}  # radix passes: the float32 bytes a dtype sets


def usable(x: torch.Tensor) -> bool:
    """Whether the kernels take these logits (callers ask only where Kernels.draw is on): at least
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
    ids = ids.contiguous()
    assert seed.numel() == rows.shape[0] and ids.shape == (v,)
    r, levels = rows.shape[0], LEVELS[x.dtype]
    out = torch.empty(r, dtype=torch.long, device=x.device)
    head = (rows, rows.stride(0), v, per, temperature)
    if not SPLIT or r > SPLIT_ROWS:
        cut_draw_kernel[(r,)](*head, top_k, top_p, seed, ids, out, LEVELS=levels, BLOCK=BLOCK, num_warps=WARPS)
        return out.view(x.shape[:-1])
    s = triton.cdiv(v, SLICE)
    hist = torch.empty(levels, r, s, 256, dtype=torch.int32, device=x.device)
    part = torch.empty(ROUNDS + 1, r, s, 8, dtype=torch.float32, device=x.device)  # partials, see PART
    floor = torch.empty(r, dtype=torch.int32, device=x.device)
    tile = dict(S_POW=triton.next_power_of_2(s), SLICE=SLICE, num_warps=SLICE_WARPS)
    for level in range(levels):
        kth_part_kernel[(r, s)](*head, top_k, hist, r, s, LEVEL=level, **tile)
    best_part_kernel[(r, s)](*head, top_k, seed, ids, hist, floor, part, r, s, LEVELS=levels, **tile)
    for round_ in range(ROUNDS):
        nucleus_part_kernel[(r, s)](*head, top_p, seed, ids, floor, part, r, s, ROUND=round_, **tile)
    finish_kernel[(r,)](*head, top_p, seed, ids, floor, part, out, r, s, S_POW=tile["S_POW"], ROUNDS=ROUNDS,
                        BLOCK=BLOCK, num_warps=WARPS)
    return out.view(x.shape[:-1])


if triton is not None:
    @triton.jit
    def mix32(x):
        """sampling.mix32 on uint32 lanes (the multiply wraps as its `& 0xFFFFFFFF` does)."""
        x = ((x >> 16) ^ x) * 0x45D9F3B
        x = ((x >> 16) ^ x) * 0x45D9F3B
        return (x >> 16) ^ x

    @triton.jit
    def ordered_key(x):
        """x's float32 bits as an int32 that orders like x (larger x, larger key)."""
        bits = x.to(tl.int32, bitcast=True)
        return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)

    @triton.jit
    def chunk(x_ptr, ids_ptr, start, n, t, seed, BLOCK: tl.constexpr):
        """Entries start..start+BLOCK of the row: their indices, which are live, x / t, its ordered
        32-bit key (larger x, larger key) and x / t plus the row's Gumbel noise (sampling.gumbel_noised;
        seed, a uint32, and the ids hold 32-bit values)."""
        offs = start + tl.arange(0, BLOCK)
        live = offs < n
        x = tl.load(x_ptr + offs, mask=live, other=-float("inf")).to(tl.float32) / t
        key = ordered_key(x)
        u = mix32(seed ^ tl.load(ids_ptr + offs, mask=live, other=0).to(tl.uint32))
        u = ((u >> 9).to(tl.float32) + 0.5) / 8388608.0  # as sampling.gumbel_noised: inside (0, 1)
        return offs, live, x, key, x - tl.log(-tl.log(u))

    @triton.jit
    def lanes_best(best, at, key, n, floor):
        """The draw among lanes (or slices, in order) holding their running bests: the largest
        score, at the lowest index holding it, and that entry's key."""
        m = tl.max(best, 0)
        i = tl.min(tl.where(best == m, at, n), 0)
        return i, tl.max(tl.where((best == m) & (at == i), key, floor), 0)

    @triton.jit
    def byte_hist(x_ptr, offs, live, prefix, LEVEL: tl.constexpr):
        """The 256-bin histogram of byte LEVEL of these entries' unsigned keys (float32 bits that order
        like x), among those whose higher bytes are `prefix`."""
        x = tl.load(x_ptr + offs, mask=live, other=0.0).to(tl.float32)
        key = ordered_key(x).to(tl.uint32, bitcast=True) ^ 0x80000000
        if LEVEL == 0:
            match = live
        else:
            match = live & ((key >> (32 - 8 * LEVEL)).to(tl.int32) == prefix)
        digit = tl.where(match, (key >> (24 - 8 * LEVEL)) & 0xFF, 0).to(tl.int32)
        bins = tl.arange(0, 256)  # the unmatched went to bin 0
        return tl.histogram(digit, 256) - tl.where(bins == 0, tl.sum(tl.where(match, 0, 1), 0), 0)

    @triton.jit
    def radix_step(hist, prefix, above, k):
        """The next byte of the k-th largest key from its histogram: (prefix with it, entries above)."""
        bins = tl.arange(0, 256)
        at_least = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # matching entries with this byte or larger
        d = tl.max(tl.where(above + at_least >= k, bins, 0), 0)
        return (prefix << 8) | d, above + tl.sum(tl.where(bins > d, hist, 0), 0)

    @triton.jit
    def key_value(prefix, LEVELS: tl.constexpr):
        """The float whose unsigned key starts with these LEVELS bytes (the rest all 0s, or all 1s for a
        negative value: the bytes a dtype does not set)."""
        low: tl.constexpr = 32 - 8 * LEVELS
        key = prefix << low
        if LEVELS < 4:
            key = tl.where(prefix < (1 << (8 * LEVELS - 1)), key | ((1 << low) - 1), key)
        bits = (key.to(tl.uint32, bitcast=True) ^ 0x80000000).to(tl.int32, bitcast=True)
        bits = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def kth_value(x_ptr, n, k, LEVELS: tl.constexpr, BLOCK: tl.constexpr):
        """The k-th largest entry of the row (1 <= k <= n), one pass over it a byte."""
        prefix = tl.zeros((), tl.int32)  # the key's bytes found so far
        above = tl.zeros((), tl.int32)  # entries whose key is larger than any that matches them
        for level in tl.static_range(LEVELS):
            hist = tl.zeros((256,), tl.int32)
            for start in range(0, n, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                hist += byte_hist(x_ptr, offs, offs < n, prefix, level)
            prefix, above = radix_step(hist, prefix, above, k)
        return key_value(prefix, LEVELS)

    @triton.jit
    def nucleus_walk(x_ptr, ids_ptr, n, t, seed, p, floor, top, at, at_key, done, BLOCK: tl.constexpr):
        """From candidate `at` on, until one lies in the nucleus: is the mass above it under p of the
        mass at or above the floor? and, in the same pass, the next candidate (the draw among the
        entries above it). Each lane keeps its running sums and best, reduced once a pass."""
        while not done:
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
                take = score > best  # an earlier chunk keeps a tie
                best = tl.where(take, score, best)
                nxt = tl.where(take, offs, nxt)
                nxt_key = tl.where(take, key, nxt_key)
            above_sum = tl.sum(above, 0)
            # nothing above: the largest x, always kept (so the loop ends)
            done = (above_sum < p * tl.sum(kept, 0)) | (above_sum == 0.0)
            if not done:
                at, at_key = lanes_best(best, nxt, nxt_key, n, floor)
        return at

    @triton.jit
    def cut_draw_kernel(x_ptr, stride, n, per, t_ptr, k_ptr, p_ptr, seed_ptr, ids_ptr, out_ptr,
                        LEVELS: tl.constexpr, BLOCK: tl.constexpr):
        r = tl.program_id(0)
        t = tl.load(t_ptr + r // per)
        at = tl.full((), 0, tl.int32)  # a greedy row (t 0) stores 0: the caller takes its argmax
        if t != 0:
            k = tl.load(k_ptr + r // per)
            p = tl.load(p_ptr + r // per)
            seed = tl.load(seed_ptr + r).to(tl.uint32)
            x_ptr += r.to(tl.int64) * stride
            floor = tl.full((), -2147483648, tl.int32)  # every key
            if (k > 0) & (k < n):  # x / t keeps the logits' order: its k-th largest is theirs over t
                floor = ordered_key(kth_value(x_ptr, n, k, LEVELS, BLOCK) / t)
            best = tl.full((BLOCK,), -float("inf"), tl.float32)  # the draw among keys >= floor
            top = tl.full((BLOCK,), -float("inf"), tl.float32)  # the row's max x
            at_v = tl.zeros((BLOCK,), tl.int32)
            key_v = tl.zeros((BLOCK,), tl.int32)
            for start in range(0, n, BLOCK):
                offs, live, x, key, score = chunk(x_ptr, ids_ptr, start, n, t, seed, BLOCK)
                top = tl.maximum(top, x)
                score = tl.where(live & (key >= floor), score, -float("inf"))
                take = score > best  # an earlier chunk keeps a tie
                best = tl.where(take, score, best)
                at_v = tl.where(take, offs, at_v)
                key_v = tl.where(take, key, key_v)
            at, at_key = lanes_best(best, at_v, key_v, n, floor)
            at = nucleus_walk(x_ptr, ids_ptr, n, t, seed, p, floor, tl.max(top, 0), at, at_key, p >= 1.0, BLOCK)
        tl.store(out_ptr + r, at.to(tl.int64))

    # Over slices. PART: a slice's partial, 8 float32 (indices and keys as their bits): score, index,
    # key of its best entry (among those the pass asks for), then the row's max x (the best pass) or
    # the kept mass and the mass above the candidate (a nucleus pass)

    @triton.jit
    def combined(part_ptr, r, NR, NS, S_POW: tl.constexpr, round_, n):
        """A pass's partials of row r, combined in slice order: the best entry (index, key), field 3's
        max and sum, field 4's sum."""
        s = tl.arange(0, S_POW)
        base = part_ptr + ((round_ * NR + r) * NS + s) * 8
        live = s < NS
        score = tl.load(base, mask=live, other=-float("inf"))
        at = tl.load(base + 1, mask=live, other=0.0).to(tl.int32, bitcast=True)
        key = tl.load(base + 2, mask=live, other=0.0).to(tl.int32, bitcast=True)
        f3 = tl.load(base + 3, mask=live, other=0.0)
        f4 = tl.load(base + 4, mask=live, other=0.0)
        i, i_key = lanes_best(score, at, key, n, tl.min(key, 0))
        return i, i_key, tl.max(tl.where(live, f3, -float("inf")), 0), tl.sum(f3, 0), tl.sum(f4, 0)

    @triton.jit
    def store_part(part_ptr, r, NR, NS, s, round_, score, at, key, f3, f4):
        base = part_ptr + ((round_ * NR + r) * NS + s) * 8
        tl.store(base, score)
        tl.store(base + 1, at.to(tl.float32, bitcast=True))
        tl.store(base + 2, key.to(tl.float32, bitcast=True))
        tl.store(base + 3, f3)
        tl.store(base + 4, f4)

    @triton.jit
    def chain(part_ptr, r, NR, NS, S_POW: tl.constexpr, p, n, ROUNDS_DONE: tl.constexpr):
        """The row's nucleus walk over the partials of the best pass and ROUNDS_DONE nucleus passes:
        (decided, candidate index, its key, the row's max x)."""
        at, at_key, top, _, _ = combined(part_ptr, r, NR, NS, S_POW, 0, n)
        done = p >= 1.0
        for j in tl.static_range(ROUNDS_DONE):
            # a decided row's later passes did not run: their partials are not read into its result
            nxt, nxt_key, _, kept, above = combined(part_ptr, r, NR, NS, S_POW, 1 + j, n)
            ok = (above < p * kept) | (above == 0.0)
            move = (not done) & (not ok)
            at = tl.where(move, nxt, at)
            at_key = tl.where(move, nxt_key, at_key)
            done = done | ok
        return done, at, at_key, top

    @triton.jit
    def radix_prefix(hist_ptr, r, NR, NS, S_POW: tl.constexpr, k, LEVELS_DONE: tl.constexpr):
        """The top LEVELS_DONE bytes of the row's k-th largest key, from the levels' histograms summed
        over slices."""
        bins = tl.arange(0, 256)
        s = tl.arange(0, S_POW)
        prefix = tl.zeros((), tl.int32)
        above = tl.zeros((), tl.int32)
        for level in tl.static_range(LEVELS_DONE):
            tile = hist_ptr + ((level * NR + r) * NS + s[:, None]) * 256 + bins[None, :]
            hist = tl.sum(tl.load(tile, mask=(s < NS)[:, None], other=0), 0)
            prefix, above = radix_step(hist, prefix, above, k)
        return prefix

    @triton.jit
    def kth_part_kernel(x_ptr, stride, n, per, t_ptr, k_ptr, hist_ptr, NR, NS, S_POW: tl.constexpr,
                        LEVEL: tl.constexpr, SLICE: tl.constexpr):
        """Byte LEVEL of the radix select over the slice."""
        r = tl.program_id(0)
        s = tl.program_id(1)
        t = tl.load(t_ptr + r // per)
        k = tl.load(k_ptr + r // per)
        if (t != 0) & (k > 0) & (k < n):
            prefix = radix_prefix(hist_ptr, r, NR, NS, S_POW, k, LEVEL)
            offs = s * SLICE + tl.arange(0, SLICE)
            hist = byte_hist(x_ptr + r.to(tl.int64) * stride, offs, offs < n, prefix, LEVEL)
            tl.store(hist_ptr + ((LEVEL * NR + r) * NS + s) * 256 + tl.arange(0, 256), hist)

    @triton.jit
    def best_part_kernel(x_ptr, stride, n, per, t_ptr, k_ptr, seed_ptr, ids_ptr, hist_ptr, floor_ptr, part_ptr,
                         NR, NS, S_POW: tl.constexpr, LEVELS: tl.constexpr, SLICE: tl.constexpr):
        """The slice's draw among the entries at or above the row's top-k floor, and its max x."""
        r = tl.program_id(0)
        s = tl.program_id(1)
        t = tl.load(t_ptr + r // per)
        if t != 0:
            k = tl.load(k_ptr + r // per)
            floor = tl.full((), -2147483648, tl.int32)  # every key
            if (k > 0) & (k < n):
                floor = ordered_key(key_value(radix_prefix(hist_ptr, r, NR, NS, S_POW, k, LEVELS), LEVELS) / t)
            seed = tl.load(seed_ptr + r).to(tl.uint32)
            offs, live, x, key, score = chunk(x_ptr + r.to(tl.int64) * stride, ids_ptr, s * SLICE, n, t, seed, SLICE)
            score = tl.where(live & (key >= floor), score, -float("inf"))
            i, i_key = lanes_best(score, offs, key, n, floor)
            store_part(part_ptr, r, NR, NS, s, 0, tl.max(score, 0), i, i_key, tl.max(x, 0), 0.0)
            if s == 0:
                tl.store(floor_ptr + r, floor)

    @triton.jit
    def nucleus_part_kernel(x_ptr, stride, n, per, t_ptr, p_ptr, seed_ptr, ids_ptr, floor_ptr, part_ptr,
                            NR, NS, S_POW: tl.constexpr, ROUND: tl.constexpr, SLICE: tl.constexpr):
        """Nucleus check ROUND of an undecided row over the slice: the kept mass, the mass above the
        candidate, and the slice's draw among the entries above it (the next candidate)."""
        r = tl.program_id(0)
        s = tl.program_id(1)
        t = tl.load(t_ptr + r // per)
        if t != 0:
            p = tl.load(p_ptr + r // per)
            done, at, at_key, top = chain(part_ptr, r, NR, NS, S_POW, p, n, ROUND)
            if not done:
                floor = tl.load(floor_ptr + r)
                seed = tl.load(seed_ptr + r).to(tl.uint32)
                offs, live, x, key, score = chunk(x_ptr + r.to(tl.int64) * stride, ids_ptr, s * SLICE, n, t, seed, SLICE)
                e = tl.where(live & (key >= floor), tl.exp(x - top), 0.0)
                score = tl.where(live & (key > at_key), score, -float("inf"))
                i, i_key = lanes_best(score, offs, key, n, at_key)
                store_part(part_ptr, r, NR, NS, s, 1 + ROUND, tl.max(score, 0), i, i_key, tl.sum(e, 0),
                           tl.sum(tl.where(key > at_key, e, 0.0), 0))

    @triton.jit
    def finish_kernel(x_ptr, stride, n, per, t_ptr, p_ptr, seed_ptr, ids_ptr, floor_ptr, part_ptr, out_ptr,
                      NR, NS, S_POW: tl.constexpr, ROUNDS: tl.constexpr, BLOCK: tl.constexpr):
        """Each row's draw: the candidate the launched checks decided on, or, for a row still
        undecided after them, the rest of its nucleus walk in this one program."""
        r = tl.program_id(0)
        t = tl.load(t_ptr + r // per)
        at = tl.full((), 0, tl.int32)  # a greedy row (t 0) stores 0: the caller takes its argmax
        if t != 0:
            p = tl.load(p_ptr + r // per)
            done, at, at_key, top = chain(part_ptr, r, NR, NS, S_POW, p, n, ROUNDS)
            at = nucleus_walk(x_ptr + r.to(tl.int64) * stride, ids_ptr, n, t, tl.load(seed_ptr + r).to(tl.uint32), p,
                              tl.load(floor_ptr + r), top, at, at_key, done, BLOCK)
        tl.store(out_ptr + r, at.to(tl.int64))
