"""Attention of a few new tokens per row over the KV cache with each token reduced alike whatever
else is in the call (`Kernels.exact` on the GPU): the exact path's counterpart of
cache_attention.py, with no host sync, so exact decode and verify steps are captured in CUDA graphs.

A token's keys are taken in position order, as the decode step that would produce it sees them:
the committed slots, then the block entries its mask shows (a tree node's ancestors, itself last),
numbered 0, 1, 2, ... as "virtual positions" (in a decode or a chain, the slots themselves). A
program takes one token and kv head, the kv head's G query heads as the rows of one tile, and one
split of SPLIT virtual positions, read in blocks of BLOCK aligned to position 0 and only up to the
token's own last key; `combine_kernel` then sums the splits in index order, where a split past a
token's keys adds exact zeros. So a token verified among T drafted tokens, in a tree or a chain,
alone or beside other rows, runs the float operations of the one-token decode that would produce
it on the same values: the same attention output, bitwise, whatever the span the step attends over.

`store_kernel` first writes the new tokens' keys and values (after Qwen3's q/k RMSNorm and RoPE, as
cache_attention.py applies them), so the attention reads every key from the cache alike. Three
kernels a layer where cache_attention.py runs one or two.
"""
from __future__ import annotations

import math

import torch

from .cache_attention import pow2, triton

if triton is not None:
    import triton.language as tl

    from .cache_attention import _head, key_block

SPLIT = 256  # virtual positions a program reads: fixed, so a token's splits do not depend on the span
BLOCK = 64


def exact_attention(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: torch.Tensor,
                    mask: torch.Tensor | None, kv_len: int, groups: int,
                    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None, pending: int = 0) -> torch.Tensor:
    """cache_attention.cache_attention's arguments and result (without its tile choices): qkv
    (B, T, H + 2 Hkv, D), the layer's cache (B, Hkv, S, D) each, start (B,) the slot of each row's
    first new token, mask (B, T, pending + T) or None (causal), kv_len >= every start + T."""
    b, t, heads, d = qkv.shape
    hkv = k_cache.shape[1]
    h = heads - 2 * hkv
    assert h == hkv * groups and qkv.stride(-1) == 1 and k_cache.stride(-1) == 1
    tree = mask is not None
    assert pending == 0 or (tree and mask.shape[-1] == pending + t)
    rows, splits = max(16, pow2(groups)), -(-kv_len // SPLIT)
    out = torch.empty(b, t, h * d, dtype=qkv.dtype, device=qkv.device)
    part_m = torch.empty(b, hkv * t, splits, rows, dtype=torch.float32, device=qkv.device)
    part_l = torch.empty_like(part_m)
    part_o = torch.empty(b, hkv * t, splits, rows, d, dtype=torch.float32, device=qkv.device)
    m = mask if tree else start  # not read without a tree
    cos, sin = rope if rope is not None else (out, out)  # not read without RoPE
    qw, kw, eps = qk_norm if qk_norm is not None else (out, out, 0.0)
    args = (qkv.stride(0), qkv.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            start.stride(0), cos.stride(0), cos.stride(1))
    store_kernel[(b, hkv)](qkv, k_cache, v_cache, start, cos, sin, kw, eps, t, *args,
                           H=h, HKV=hkv, TP=max(16, pow2(t)), D=d, ROPE=rope is not None, QK_NORM=qk_norm is not None)
    attend_kernel[(b, hkv * t, splits)](
        qkv, k_cache, v_cache, start, m, part_m, part_l, part_o, cos, sin, qw, eps, 1.0 / math.sqrt(d), t, pending,
        *args, m.stride(0) if tree else 0, m.stride(1) if tree else 0, m.stride(2) if tree else 0,
        G=groups, ROWS=rows, E=max(16, pow2(pending + t)), D=d, SPLIT=SPLIT, BLOCK=BLOCK, TREE=tree,
        ROPE=rope is not None, QK_NORM=qk_norm is not None)
    combine_kernel[(b, hkv * t)](part_m, part_l, part_o, out, splits, t, out.stride(0), out.stride(1),
                                 G=groups, ROWS=rows, D=d)
    return out


if triton is not None:
    @triton.jit
    def store_kernel(QKV, K, V, START, COS, SIN, KW, eps, T, s_b, s_t, sk_b, sk_h, sk_s, s_start, sc_b, sc_t,
                     H: tl.constexpr, HKV: tl.constexpr, TP: tl.constexpr, D: tl.constexpr, ROPE: tl.constexpr,
                     QK_NORM: tl.constexpr):
        """The new tokens' keys (normed, rotated) and values of row b, kv head h, into slots start + u."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        start = tl.load(START + b * s_start).to(tl.int32)
        d = tl.arange(0, D)
        u = tl.arange(0, TP)
        um = u < T
        k = _head(QKV, COS, SIN, KW, eps, b * s_b + u * s_t + (H + h) * D, u, sc_b, sc_t, b, um, D, ROPE, QK_NORM)
        v = tl.load(QKV + b * s_b + u[:, None] * s_t + (H + HKV + h) * D + d[None, :], mask=um[:, None], other=0.0)
        dst = b * sk_b + h * sk_h + (start + u)[:, None] * sk_s + d[None, :]
        tl.store(K + dst, k, mask=um[:, None])
        tl.store(V + dst, v, mask=um[:, None])

    @triton.jit
    def attend_kernel(QKV, K, V, START, MASK, PM, PL, PO, COS, SIN, QW, eps, scale, T, P,
                      s_b, s_t, sk_b, sk_h, sk_s, s_start, sc_b, sc_t, sm_b, sm_t, sm_u,
                      G: tl.constexpr, ROWS: tl.constexpr, E: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr,
                      BLOCK: tl.constexpr, TREE: tl.constexpr, ROPE: tl.constexpr, QK_NORM: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1) // T
        t = tl.program_id(1) % T
        sp = tl.program_id(2)
        start = tl.load(START + b * s_start).to(tl.int32)
        committed = start - P  # slots every new token sees
        d = tl.arange(0, D)
        g = tl.arange(0, ROWS)
        gm = g < G
        hq = h * G + g
        q = _head(QKV, COS, SIN, QW, eps, b * s_b + t * s_t + hq * D, tl.zeros([ROWS], tl.int32) + t, sc_b, sc_t, b,
                  gm, D, ROPE, QK_NORM)
        e = tl.arange(0, E)  # the block entries: the pending slots, then the new tokens
        if TREE:
            seen = tl.load(MASK + b * sm_b + t * sm_t + e * sm_u, mask=e < P + T, other=0) != 0
        else:
            seen = e <= P + t
        rank = tl.cumsum(seen.to(tl.int32), 0) - 1  # an entry's place among the ones this token sees
        n = committed + tl.sum(seen.to(tl.int32), 0)  # this token's keys: virtual positions 0 .. n-1
        cache = b * sk_b + h * sk_h
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], dtype=tl.float32)
        acc = tl.zeros([ROWS, D], dtype=tl.float32)
        lo = sp * SPLIT
        hi = tl.minimum(lo + SPLIT, n)
        for s0 in range(lo, hi, BLOCK):
            pos = s0 + tl.arange(0, BLOCK)
            live = pos < hi
            pick = seen[None, :] & (rank[None, :] == (pos - committed)[:, None])  # (BLOCK, E)
            slot = tl.where(pos < committed, pos, committed + tl.sum(tl.where(pick, e[None, :], 0), 1))
            m_i, l_i, acc = key_block(q, K + cache, V + cache, slot, live, d, sk_s, scale, m_i, l_i, acc)
        part = (b * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2) + sp
        tl.store(PM + part * ROWS + g, m_i)
        tl.store(PL + part * ROWS + g, l_i)
        tl.store(PO + (part * ROWS + g[:, None]) * D + d[None, :], acc)

    @triton.jit
    def combine_kernel(PM, PL, PO, OUT, splits, T, so_b, so_t, G: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr):
        """A token's splits summed one after another in index order (a split it has no key in: weight 0)."""
        b = tl.program_id(0)
        h = tl.program_id(1) // T
        t = tl.program_id(1) % T
        g = tl.arange(0, ROWS)
        d = tl.arange(0, D)
        base = (b * tl.num_programs(1) + tl.program_id(1)) * splits
        m_all = tl.full([ROWS], float("-inf"), tl.float32)
        for i in range(0, splits):
            m_all = tl.maximum(m_all, tl.load(PM + (base + i) * ROWS + g))
        denom = tl.zeros([ROWS], dtype=tl.float32)
        o = tl.zeros([ROWS, D], dtype=tl.float32)
        for i in range(0, splits):
            w = tl.exp(tl.load(PM + (base + i) * ROWS + g) - m_all)
            denom += w * tl.load(PL + (base + i) * ROWS + g)
            o += w[:, None] * tl.load(PO + ((base + i) * ROWS + g[:, None]) * D + d[None, :])
        o = o / denom[:, None]
        tl.store(OUT + b * so_b + t * so_t + (h * G + g)[:, None] * D + d[None, :], o.to(OUT.dtype.element_ty),
                 mask=(g < G)[:, None])
