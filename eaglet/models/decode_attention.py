"""Attention for one new token per row (plain decoding, chain drafting) as one Triton kernel.

The general path (models/llama.py) stores the new keys and values with an indexed write, builds an
additive mask and calls SDPA: three to four kernels per layer, each a few microseconds of launch
latency while the bytes they move take well under one. Here one kernel does it all: for each row b
and kv head it stores the new key and value at the row's slot and attends its query heads over the
slots before it plus the new token (in registers, so nothing is read back that the kernel wrote).

Long spans are split: each program takes `chunk` slots and, when there is more than one split,
writes its partial softmax state (max, sum, weighted values) for a second, small kernel to combine
(flash-decoding). One split needs no second kernel. The split size comes from the measurements of
bench/gpu/attention_probe.py (BENCHMARKS.md).

Used when a forward has one token per row that sees every slot up to its own (AttnMeta.causal, no
sliding window), in bfloat16 or float16, on the GPU with Triton and compiled kernels on
(runtime/compile.py turns it on), or anywhere under TRITON_INTERPRET=1 (the CPU tests).
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

_on = False
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MAX_SPLITS = 64  # the combine kernel's width


def enable(on: bool = True) -> None:
    global _on
    _on = on


def usable(q: torch.Tensor) -> bool:
    return (_on and triton is not None and q.dtype in (torch.bfloat16, torch.float16)
            and (q.is_cuda or INTERPRET))


def split_size(kv_len: int) -> int:
    """Slots per program: one program per row and head up to 512 slots, then at most 16 splits."""
    if kv_len <= 512:
        return max(64, triton.next_power_of_2(kv_len))
    return max(512, triton.next_power_of_2(-(-kv_len // 16)))


def decode_attention(q: torch.Tensor, kv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slots: torch.Tensor, kv_len: int, chunk: int | None = None) -> torch.Tensor:
    """q (B, Hkv, G, D): each kv head's query heads; kv (B, 1, 2, Hkv, D): the new key and value;
    k_cache, v_cache (B, Hkv, S, D): this layer's cache rows; slots (B,) or (B, 1): where the new
    token goes (it sees slots 0..slot); kv_len: slots a step may attend over (> every slot).
    Stores the new key and value and returns the attention output (B, Hkv * G * D)."""
    b, hkv, g, d = q.shape
    slots = slots.reshape(b)
    chunk = chunk or split_size(kv_len)
    splits = -(-kv_len // chunk)
    if splits > MAX_SPLITS:
        raise ValueError(f"decode attention: {splits} splits of {chunk} slots exceed {MAX_SPLITS}")
    out = torch.empty(b, hkv * g * d, dtype=q.dtype, device=q.device)
    gp = max(16, triton.next_power_of_2(g))  # tl.dot needs 16 rows
    if splits == 1:
        part_m = part_l = part_o = out  # unused
    else:
        part_m = torch.empty(b, hkv, splits, gp, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_o = torch.empty(b, hkv, splits, gp, d, dtype=torch.float32, device=q.device)
    _attend[(b, hkv, splits)](
        q, kv, k_cache, v_cache, slots, out, part_m, part_l, part_o, 1.0 / math.sqrt(d), chunk,
        q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(2), kv.stride(3),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        G=g, GP=gp, D=d, BLOCK=64, SPLIT=splits > 1)
    if splits > 1:
        _combine[(b, hkv)](part_m, part_l, part_o, out, splits, G=g, GP=gp, D=d,
                           SP=max(2, triton.next_power_of_2(splits)))
    return out


if triton is not None:
    @triton.jit
    def _attend(Q, KV, K, V, SLOT, OUT, PM, PL, PO, scale, chunk,
                sq_b, sq_h, sq_g, skv_b, skv_c, skv_h, sk_b, sk_h, sk_s,
                G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, SPLIT: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.program_id(2)
        slot = tl.load(SLOT + b).to(tl.int32)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        gm = g < G
        q = tl.load(Q + b * sq_b + h * sq_h + g[:, None] * sq_g + d[None, :], mask=gm[:, None], other=0.0)
        kv_base = KV + b * skv_b + h * skv_h + d
        k_new = tl.load(kv_base)
        v_new = tl.load(kv_base + skv_c)
        cache = b * sk_b + h * sk_h
        lo = sp * chunk
        owner = (slot >= lo) & (slot < lo + chunk)  # this split holds the new token
        tl.store(K + cache + slot * sk_s + d, k_new, mask=owner & (d < D))
        tl.store(V + cache + slot * sk_s + d, v_new, mask=owner & (d < D))
        # the new token first, from registers; then the cached slots [lo, min(lo + chunk, slot))
        s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * scale  # (GP,)
        m_i = tl.where(owner, s_new, float("-inf"))
        l_i = tl.where(owner, 1.0, 0.0) + tl.zeros([GP], dtype=tl.float32)
        acc = tl.where(owner, 1.0, 0.0) * v_new.to(tl.float32)[None, :] + tl.zeros([GP, D], dtype=tl.float32)
        hi = tl.minimum(lo + chunk, slot)
        for start in range(lo, hi, BLOCK):
            s = start + tl.arange(0, BLOCK)
            sm = s < hi
            k = tl.load(K + cache + s[:, None] * sk_s + d[None, :], mask=sm[:, None], other=0.0)
            v = tl.load(V + cache + s[:, None] * sk_s + d[None, :], mask=sm[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k)) * scale  # (GP, BLOCK), fp32
            scores = tl.where(sm[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        if SPLIT:
            part = (b * tl.num_programs(1) + h) * tl.num_programs(2) + sp
            tl.store(PM + part * GP + g, m_i)
            tl.store(PL + part * GP + g, l_i)
            tl.store(PO + (part * GP + g[:, None]) * D + d[None, :], acc)
        else:
            o = acc / l_i[:, None]
            tl.store(OUT + b * (tl.num_programs(1) * G * D) + (h * G + g[:, None]) * D + d[None, :],
                     o.to(OUT.dtype.element_ty), mask=gm[:, None])

    @triton.jit
    def _combine(PM, PL, PO, OUT, splits, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, SP: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.arange(0, SP)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        sm = s < splits
        part = (b * tl.num_programs(1) + h) * splits + s  # (SP,)
        m = tl.load(PM + part[:, None] * GP + g[None, :], mask=sm[:, None], other=float("-inf"))  # (SP, GP)
        l = tl.load(PL + part[:, None] * GP + g[None, :], mask=sm[:, None], other=0.0)
        m_all = tl.max(m, 0)  # (GP,): finite, one split holds the new token
        w = tl.where(sm[:, None], tl.exp(m - m_all[None, :]), 0.0)  # (SP, GP)
        denom = tl.sum(w * l, 0)
        o = tl.zeros([GP, D], dtype=tl.float32)
        for i in range(0, splits):
            wi = tl.sum(tl.where(s[:, None] == i, w, 0.0), 0)  # (GP,)
            po = tl.load(PO + (((b * tl.num_programs(1) + h) * splits + i) * GP + g[:, None]) * D + d[None, :])
            o += wi[:, None] * po
        o = o / denom[:, None]
        tl.store(OUT + b * (tl.num_programs(1) * G * D) + (h * G + g[:, None]) * D + d[None, :],
                 o.to(OUT.dtype.element_ty), mask=(g < G)[:, None])
