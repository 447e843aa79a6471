"""Attention of a few new tokens per row over the KV cache, as one Triton kernel: decoding (one
token), chain drafting, verifying a chain or a tree, a drafter absorbing what was accepted.

The general path (models/llama.py) stores the new keys and values with an indexed write, relays
out the queries, builds an additive mask and calls SDPA, then copies the output back to token
order: six or seven kernels per layer, each a few microseconds of launch latency while the bytes
they move take well under one. Here one kernel does all of it. It reads q, k and v of the new
tokens from the q/k/v projection's output (B, T, H + 2 Hkv, D), applies RoPE (after Qwen3's q/k
RMSNorm) to q and k as it loads them, stores k and v at slots
start .. start+T-1 of each row, and attends each query over the slots before `start` (all
visible: the committed prefix and any block entries of earlier forwards, except a draft tree's
earlier levels, which its mask covers) and over the new tokens themselves, causally or as a tree
mask allows. The new tokens' keys are used from registers, so
nothing is read back that the kernel wrote. The output is written in token order (B, T, H * D).

Programs: one per row, kv head, tile of query rows (the kv head's G heads times T tokens), and
split of the cached span. Long spans are split (flash-decoding): each split writes its partial
softmax state for a second, small kernel to combine; one split needs no second kernel. The split
rule comes from bench/gpu/cache_attention_probe.py's measurements (BENCHMARKS.md).

Used for bfloat16 and float16 where a model's `Kernels.cache_attention` is on (eaglet/kernels.py:
the GPU with Triton); under TRITON_INTERPRET=1 (the CPU tests) on any device.

Rounding: like FlashAttention, the softmax weights are cast to the model's dtype for the P·V
product. A token verified inside a block sees its keys grouped differently from the same token
decoded alone, so the two round differently and bfloat16 greedy near-ties can flip between plain
and speculative decoding. P·V in float32 does not change how often speculative bfloat16 output
equals plain, only the time (docs/notebook.md), so the kernel keeps FlashAttention's choice.
"""
from __future__ import annotations

import math
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without Triton: the SDPA path runs
    triton = None

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MAX_TOKENS = 64  # longer blocks (prefill) take the SDPA path
MAX_SPLITS = 64


def dependent_launch(x: torch.Tensor) -> bool:
    """Whether a kernel may start while the kernel before it finishes (programmatic dependent launch,
    compute capability 9+): its launch and its first weight loads overlap that kernel's tail, each
    program waiting for the previous kernel's results before it reads them (the one-row GEMVs and
    norms, MoE's routing, down and combine kernels)."""
    return not INTERPRET and x.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 9


def usable(x: torch.Tensor, tokens: int) -> bool:
    """Whether the kernel takes this forward (a cache asks only where Kernels.cache_attention is on)."""
    return (triton is not None and tokens <= MAX_TOKENS
            and x.dtype in (torch.bfloat16, torch.float16) and (x.is_cuda or INTERPRET))


def pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): Triton block sizes."""
    return 1 << max(0, n - 1).bit_length()


def row_tiles(groups: int, tokens: int, heads: int = 1) -> tuple[int, int]:
    """Query rows per program and programs per row and kv head: a kv head's groups * tokens query
    rows in tiles of 16 to 64 (tl.dot needs at least 16). With few programs (heads = batch x kv
    heads <= 16) small tiles win: more programs stream the cache; at 6 and 16 new tokens a 16-row
    tile took 0.73-0.83x the time of the 32- or 64-row one on the H200 (batch 1, SmolLM2 and
    Llama-3.1-8B heads, cache-attention-tiles-gpu-20261130-092317.json). With many programs one
    tile per head reads the cache once."""
    n = groups * tokens
    cap = 64 if heads > 16 else 16 if n <= 64 else 32
    rows = min(cap, max(16, pow2(n)))
    return rows, -(-n // rows)


def split_size(kv_len: int, programs: int) -> int:
    """Cached slots per split, for `programs` programs before splitting: short spans in one split;
    longer ones in splits of 128 (up to 512 slots) or 256, as many as keep ~256 programs busy."""
    if kv_len <= 256:
        return max(64, pow2(kv_len))
    splits = min(max(1, 256 // programs), -(-kv_len // (128 if kv_len <= 512 else 256)), MAX_SPLITS)
    return max(64, pow2(-(-kv_len // splits)))


def cache_attention(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: torch.Tensor,
                    mask: torch.Tensor | None, kv_len: int, groups: int, chunk: int | None = None,
                    rows: int | None = None, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None, pending: int = 0) -> torch.Tensor:
    """qkv (B, T, H + 2 Hkv, D): queries, keys, values of T new tokens per row (query head
    h = kv * groups + g); k_cache, v_cache (B, Hkv, S, D): this layer's cache rows; start (B,):
    the slot of each row's first new token (every slot before it is visible; any stride); mask
    (B, T, pending + T) bool, new token t sees block entry u: the `pending` slots before start (a
    draft tree's earlier levels), then the new tokens; or None for causal with every slot before
    start visible; kv_len: slots a step may attend over (>= every
    start + T); chunk, rows: slots per split and query rows per program, instead of the rules
    (split_size, row_tiles; for probes); rope: cos, sin (B, T, 1, D) in the rotate-half layout, or
    None when q and k come rotated; qk_norm: (q weight, k weight, eps) of an RMSNorm over each head
    before the rotation (Qwen3). Stores the new (rotated) keys and values; returns the attention
    output (B, T, H * D)."""
    b, t, heads, d = qkv.shape
    hkv = k_cache.shape[1]
    h = heads - 2 * hkv
    assert h == hkv * groups and qkv.stride(-1) == 1 and k_cache.stride(-1) == 1
    rows, tiles = row_tiles(groups, t, b * hkv) if rows is None else (rows, -(-groups * t // rows))
    chunk = chunk or split_size(kv_len, b * hkv * tiles)
    splits = -(-kv_len // chunk)
    if splits > MAX_SPLITS:
        raise ValueError(f"cache attention: {splits} splits of {chunk} slots exceed {MAX_SPLITS}")
    out = torch.empty(b, t, h * d, dtype=qkv.dtype, device=qkv.device)
    if splits > 1:
        part_m = torch.empty(b, hkv * tiles, splits, rows, dtype=torch.float32, device=qkv.device)
        part_l = torch.empty_like(part_m)
        part_o = torch.empty(b, hkv * tiles, splits, rows, d, dtype=torch.float32, device=qkv.device)
    else:
        part_m = part_l = part_o = out  # not read
    tree = mask is not None
    assert pending == 0 or (tree and mask.shape[-1] == pending + t)
    m = mask if tree else start  # not read without a tree
    cos, sin = rope if rope is not None else (out, out)  # not read without RoPE
    assert rope is None or (cos.shape[:2] == (b, t) and cos.stride() == sin.stride() and cos.stride(-1) == 1)
    assert qk_norm is None or rope is not None  # the kernel norms q and k on the way to rotating them
    qw, kw, eps = qk_norm if qk_norm is not None else (out, out, 0.0)
    attend_kernel[(b, hkv * tiles, splits)](
        qkv, k_cache, v_cache, start, m, out, part_m, part_l, part_o, cos, sin, qw, kw, eps, 1.0 / math.sqrt(d),
        chunk, t, qkv.stride(0), qkv.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        start.stride(0), m.stride(0) if tree else 0, m.stride(1) if tree else 0, m.stride(2) if tree else 0,
        out.stride(0), out.stride(1), cos.stride(0), cos.stride(1), pending,
        H=h, HKV=hkv, G=groups, TILES=tiles, ROWS=rows, TP=max(16, pow2(t)), PP=max(16, pow2(pending)), D=d, BLOCK=64,
        TREE=tree, SPLIT=splits > 1, ROPE=rope is not None, QK_NORM=qk_norm is not None)
    if splits > 1:
        # the o projection's one-row GEMV, launched dependent on this kernel, may start now and read its weights
        combine_kernel[(b, hkv * tiles)](part_m, part_l, part_o, out, splits, t, out.stride(0), out.stride(1),
                                   G=groups, TILES=tiles, ROWS=rows, D=d, SP=max(2, pow2(splits)),
                                   TRIGGER=dependent_launch(qkv))
    return out


if triton is not None:
    @triton.jit
    def _head(QKV, COS, SIN, W, eps, off, tok, sc_b, sc_t, b, m, D: tl.constexpr, ROPE: tl.constexpr,
              NORM: tl.constexpr):
        """Rows of one head's q or k at QKV + off (len(off) rows of D), tokens `tok`, rows `m` real:
        RMSNorm'd with W when NORM, rotated by RoPE when ROPE (the rotate-half partner of element i
        is i + D/2 mod D, read again from memory), rounded once to the input's dtype like the
        compiled modules."""
        d = tl.arange(0, D)
        x = tl.load(QKV + off[:, None] + d[None, :], mask=m[:, None], other=0.0)
        if ROPE:
            dr = (d + D // 2) % D
            xf = x.to(tl.float32)
            x2 = tl.load(QKV + off[:, None] + dr[None, :], mask=m[:, None], other=0.0).to(tl.float32)
            if NORM:  # RMSNorm(head): weight * (x / rms).to(dtype), rounded
                inv = tl.rsqrt(tl.sum(xf * xf, 1) / D + eps)[:, None]
                xf = (tl.load(W + d).to(tl.float32)[None, :] * (xf * inv).to(x.dtype).to(tl.float32)).to(x.dtype)
                x2 = (tl.load(W + dr).to(tl.float32)[None, :] * (x2 * inv).to(x.dtype).to(tl.float32)).to(x.dtype)
                xf, x2 = xf.to(tl.float32), x2.to(tl.float32)
            cs = b * sc_b + tok[:, None] * sc_t + d[None, :]
            cos = tl.load(COS + cs, mask=m[:, None], other=0.0).to(tl.float32)
            sin = tl.load(SIN + cs, mask=m[:, None], other=0.0).to(tl.float32)
            x = (xf * cos + tl.where(d < D // 2, -x2, x2) * sin).to(x.dtype)
        return x

    @triton.jit
    def fold(scores, seen, v, m_i, l_i, acc):
        """Scores of a block of keys (scaled; masked where not `seen`) and their values `v` into a running
        softmax (max m_i, sum l_i, output acc), the weights in the values' dtype for P·V: the new state.
        A row that has seen nothing yet keeps m = -inf and adds nothing."""
        scores = tl.where(seen, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)

    @triton.jit
    def key_block(q, K, V, slot, live, d, sk_s, scale, m_i, l_i, acc):
        """One block of cached keys and values (at `slot`, `live`: which exist) into a running softmax
        (fold)."""
        k = tl.load(K + slot[:, None] * sk_s + d[None, :], mask=live[:, None], other=0.0)
        v = tl.load(V + slot[:, None] * sk_s + d[None, :], mask=live[:, None], other=0.0)
        return fold(tl.dot(q, tl.trans(k)) * scale, live[None, :], v, m_i, l_i, acc)


    @triton.jit
    def attend_kernel(QKV, K, V, START, MASK, OUT, PM, PL, PO, COS, SIN, QW, KW, eps, scale, chunk, T,
                s_b, s_t, sk_b, sk_h, sk_s, s_start, sm_b, sm_t, sm_u, so_b, so_t, sc_b, sc_t, P,
                H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, TILES: tl.constexpr, ROWS: tl.constexpr,
                TP: tl.constexpr, PP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, TREE: tl.constexpr, SPLIT: tl.constexpr,
                ROPE: tl.constexpr, QK_NORM: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1) // TILES
        tile = tl.program_id(1) % TILES
        sp = tl.program_id(2)
        last = sp == tl.num_programs(2) - 1  # the split that also takes the new tokens
        start = tl.load(START + b * s_start).to(tl.int32)
        d = tl.arange(0, D)
        r = tile * ROWS + tl.arange(0, ROWS)  # query rows: token r // G, head h * G + r % G
        tq = r // G
        rm = tq < T
        q = _head(QKV, COS, SIN, QW, eps, b * s_b + tq * s_t + (h * G + r % G) * D, tq, sc_b, sc_t, b, rm, D, ROPE,
                  QK_NORM)
        u = tl.arange(0, TP)  # the new tokens as keys
        um = u < T
        k_new = _head(QKV, COS, SIN, KW, eps, b * s_b + u * s_t + (H + h) * D, u, sc_b, sc_t, b, um, D, ROPE, QK_NORM)
        v_new = tl.load(QKV + b * s_b + u[:, None] * s_t + (H + HKV + h) * D + d[None, :], mask=um[:, None], other=0.0)
        cache = b * sk_b + h * sk_h
        keep = tl.where(last & (tile == 0), um, False)[:, None]  # one writer per row and kv head
        tl.store(K + cache + (start + u)[:, None] * sk_s + d[None, :], k_new, mask=keep)
        tl.store(V + cache + (start + u)[:, None] * sk_s + d[None, :], v_new, mask=keep)
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], dtype=tl.float32)
        acc = tl.zeros([ROWS, D], dtype=tl.float32)
        lo = sp * chunk
        hi = tl.minimum(lo + chunk, start - P)
        for s0 in range(lo, hi, BLOCK):  # cached slots, every one visible
            s = s0 + tl.arange(0, BLOCK)
            m_i, l_i, acc = key_block(q, K + cache, V + cache, s, s < hi, d, sk_s, scale, m_i, l_i, acc)
        if TREE:
            if last & (P > 0):  # the pending slots (a tree's earlier levels): what the mask allows
                j = tl.arange(0, PP)
                jm = j < P
                s = start - P + j
                k = tl.load(K + cache + s[:, None] * sk_s + d[None, :], mask=jm[:, None], other=0.0)
                v = tl.load(V + cache + s[:, None] * sk_s + d[None, :], mask=jm[:, None], other=0.0)
                seen = tl.load(MASK + b * sm_b + tq[:, None] * sm_t + j[None, :] * sm_u, mask=rm[:, None] & jm[None, :],
                               other=0) != 0
                m_i, l_i, acc = fold(tl.dot(q, tl.trans(k)) * scale, seen, v, m_i, l_i, acc)
        if last:  # the new tokens
            if TREE:
                seen = tl.load(MASK + b * sm_b + tq[:, None] * sm_t + (P + u)[None, :] * sm_u,
                               mask=rm[:, None] & um[None, :], other=0)
                seen = seen != 0
            else:
                seen = (u[None, :] <= tq[:, None]) & um[None, :]
            m_i, l_i, acc = fold(tl.dot(q, tl.trans(k_new)) * scale, seen, v_new, m_i, l_i, acc)  # padded rows see nothing
        if SPLIT:
            part = (b * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2) + sp
            rr = tl.arange(0, ROWS)
            tl.store(PM + part * ROWS + rr, m_i)
            tl.store(PL + part * ROWS + rr, l_i)
            tl.store(PO + (part * ROWS + rr[:, None]) * D + d[None, :], acc)
        else:
            o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # padded rows: 0
            tl.store(OUT + b * so_b + tq[:, None] * so_t + (h * G + r % G)[:, None] * D + d[None, :],
                     o.to(OUT.dtype.element_ty), mask=rm[:, None])

    @triton.jit
    def combine_kernel(PM, PL, PO, OUT, splits, T, so_b, so_t,
                 G: tl.constexpr, TILES: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, SP: tl.constexpr,
                 TRIGGER: tl.constexpr = False):
        if TRIGGER:
            tl.extra.cuda.gdc_launch_dependents()
        b = tl.program_id(0)
        h = tl.program_id(1) // TILES
        tile = tl.program_id(1) % TILES
        s = tl.arange(0, SP)
        rr = tl.arange(0, ROWS)
        d = tl.arange(0, D)
        sm = s < splits
        base = (b * tl.num_programs(1) + tl.program_id(1)) * splits
        m = tl.load(PM + (base + s)[:, None] * ROWS + rr[None, :], mask=sm[:, None], other=float("-inf"))  # (SP, ROWS)
        lsum = tl.load(PL + (base + s)[:, None] * ROWS + rr[None, :], mask=sm[:, None], other=0.0)
        m_all = tl.max(m, 0)
        m_all = tl.where(m_all == float("-inf"), 0.0, m_all)  # padded rows
        w = tl.where(sm[:, None], tl.exp(m - m_all[None, :]), 0.0)  # (SP, ROWS)
        denom = tl.sum(w * lsum, 0)
        o = tl.zeros([ROWS, D], dtype=tl.float32)
        for i in range(0, splits):
            wi = tl.sum(tl.where(s[:, None] == i, w, 0.0), 0)  # (ROWS,)
            o += wi[:, None] * tl.load(PO + ((base + i) * ROWS + rr[:, None]) * D + d[None, :])
        o = o / tl.where(denom == 0.0, 1.0, denom)[:, None]
        r = tile * ROWS + rr
        tq = r // G
        tl.store(OUT + b * so_b + tq[:, None] * so_t + (h * G + r % G)[:, None] * D + d[None, :],
                 o.to(OUT.dtype.element_ty), mask=(tq < T)[:, None])
