"""MLA's attention over the latent cache for a few new tokens per row, as one Triton kernel: decoding,
chain drafting, verifying a chain or a tree (models/mla.py's absorbed form).

The general path takes about ten kernels a layer for this: the rotary part of q and k and the
latent's RMSNorm (compiled), the cache's indexed store, the nope and rotary scores (three cuBLAS
calls), the masked softmax and the weighted sum of latents (cuBLAS), each a few microseconds of
launch latency at decode sizes. Here one kernel does all of it. It takes the query already in
latent space (q_nope times kv_b_proj's key rows: `q_lat`, a batched matmul before it) and q's
rotary part, and the kv_a projection's output of the new tokens (latent, then the shared rotary
key): it norms the latent (kv_a_layernorm), rotates q's and k's rotary parts (de-interleaving
DeepSeek's pairs first), stores each new token's cache entry (normed latent, rotated key) at
slots start .. start+T-1 of its row, and attends every query row (token t, head h) over the slots
before `start` (all visible, but a draft tree's `pending` earlier levels, which its mask covers)
and over the new tokens (causally or as the tree mask allows). Keys are the whole entries, values
their latents, so the output is the attention-weighted latent per head (B, T, nh, kv_lora_rank),
which kv_b_proj's value rows turn into each head's output (a batched matmul after it).

Programs: one per row, tile of query rows (heads x tokens) and split of the cached span; splits
are combined by cache_attention's combine kernel (the same partial-state layout, one kv head of
nh query heads). Rounding as cache_attention: scores and softmax in float32, the weights cast to
the latents' dtype for P.V. Used where a model's `Kernels.cache_attention` is on (the GPU with
Triton; under TRITON_INTERPRET=1 the CPU tests), bfloat16 and float16, kv_lora_rank a power of two.
"""
from __future__ import annotations

import torch

from .cache_attention import INTERPRET, MAX_SPLITS, MAX_TOKENS, pow2, split_size, triton

if triton is not None:
    import triton.language as tl
    from .cache_attention import combine_kernel, fold

ROWS = 16  # query rows a program (tl.dot's least): a decode step of 16 heads is one tile
BLOCK = 32  # cached entries a loop iteration: a (32, kv_lora_rank) tile of latents
CHUNK = 64  # latent columns a score's dot takes at a time


def usable(x: torch.Tensor, tokens: int, kv_lora_rank: int, rope_dim: int) -> bool:
    """Whether the kernel takes this forward (asked only where Kernels.cache_attention is on)."""
    return (triton is not None and tokens <= MAX_TOKENS and x.dtype in (torch.bfloat16, torch.float16)
            and (x.is_cuda or INTERPRET) and kv_lora_rank >= 16 and pow2(kv_lora_rank) == kv_lora_rank
            and rope_dim % 2 == 0)


def mla_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, norm: tuple[torch.Tensor, float],
                  cache: torch.Tensor, start: torch.Tensor, mask: torch.Tensor | None, kv_len: int, pending: int,
                  rope: tuple[torch.Tensor, torch.Tensor], interleaved: bool, scale: float,
                  chunk: int | None = None) -> torch.Tensor:
    """q_lat (B, T, nh, C): queries in latent space; q_pe (B, T, nh, R): q's rotary part, not yet
    rotated; kv (B, T, C + R): the kv_a projection of the new tokens (latent not yet normed, rotary
    key not yet rotated); norm: (kv_a_layernorm's weight, eps); cache (B, S, C + R): this layer's
    latent cache rows; start (B,): each row's first new slot; mask (B, T, pending + T) bool, or None
    for causal with every slot before start visible; kv_len: slots a step may attend over; rope:
    cos, sin (B, T, 1, R) in the rotate-half layout; interleaved: q_pe and k_pe hold their rotary
    pairs interleaved (DeepSeek); chunk: slots per split instead of split_size's (for tests).
    Stores the new entries; returns the attention-weighted latents (B, T, nh, C)."""
    b, t, nh, c = q_lat.shape
    r = q_pe.shape[-1]
    q_lat = q_lat if q_lat.stride(-1) == 1 else q_lat.contiguous()
    assert kv.shape == (b, t, c + r) and cache.shape[-1] == c + r and q_pe.shape[:3] == (b, t, nh)
    assert q_pe.stride(-1) == 1 and kv.stride(-1) == 1 and cache.stride(-1) == 1
    cos, sin = rope
    assert cos.shape[:2] == (b, t) and cos.stride() == sin.stride() and cos.stride(-1) == 1
    tiles = -(-nh * t // ROWS)
    chunk = chunk or split_size(kv_len, b * tiles)
    splits = -(-kv_len // chunk)
    if splits > MAX_SPLITS:
        raise ValueError(f"MLA attention: {splits} splits of {chunk} slots exceed {MAX_SPLITS}")
    out = torch.empty(b, t, nh * c, dtype=q_lat.dtype, device=q_lat.device)
    if splits > 1:
        part_m = torch.empty(b, tiles, splits, ROWS, dtype=torch.float32, device=q_lat.device)
        part_l = torch.empty_like(part_m)
        part_o = torch.empty(b, tiles, splits, ROWS, c, dtype=torch.float32, device=q_lat.device)
    else:
        part_m = part_l = part_o = out  # not read
    tree = mask is not None
    assert pending == 0 or (tree and mask.shape[-1] == pending + t)
    m = mask if tree else start  # not read without a tree
    weight, eps = norm
    mla_kernel[(b, tiles, splits)](
        q_lat, q_pe, kv, weight, eps, cos, sin, cache, start, m, out, part_m, part_l, part_o, scale, chunk, t, pending,
        q_lat.stride(0), q_lat.stride(1), q_lat.stride(2), q_pe.stride(0), q_pe.stride(1), q_pe.stride(2),
        kv.stride(0), kv.stride(1), cache.stride(0), cache.stride(1), start.stride(0),
        m.stride(0) if tree else 0, m.stride(1) if tree else 0, m.stride(2) if tree else 0,
        out.stride(0), out.stride(1), cos.stride(0), cos.stride(1),
        NH=nh, C=c, R=r, RP=max(16, pow2(r)), ROWS=ROWS, TP=max(16, pow2(t)), PP=max(16, pow2(pending)), BLOCK=BLOCK,
        CK=min(c, CHUNK),
        TREE=tree, SPLIT=splits > 1, INTERLEAVED=interleaved, num_warps=8)
    if splits > 1:
        combine_kernel[(b, tiles)](part_m, part_l, part_o, out, splits, t, out.stride(0), out.stride(1),
                                   G=nh, TILES=tiles, ROWS=ROWS, D=c, SP=max(2, pow2(splits)))
    return out.view(b, t, nh, c)


if triton is not None:
    @triton.jit
    def _rotated(X, off, tok, rows_m, COS, SIN, sc_b, sc_t, b, R: tl.constexpr, RP: tl.constexpr,
                 INTERLEAVED: tl.constexpr):
        """Rows of a rotary part at X + off (len(off) rows of R, token `tok` each, `rows_m` real) rotated
        by RoPE in the rotate-half layout (interleaved pairs de-interleaved as they load), float32,
        padded to RP columns with zeros."""
        e = tl.arange(0, RP)
        em = e < R
        partner = (e + R // 2) % R  # the rotate-half partner of element e
        if INTERLEAVED:  # element e of the de-interleaved vector is x[2e] (first half) or x[2(e - R/2) + 1]
            src = tl.where(e < R // 2, 2 * e, 2 * (e - R // 2) + 1)
            src2 = tl.where(partner < R // 2, 2 * partner, 2 * (partner - R // 2) + 1)
        else:
            src, src2 = e, partner
        m = rows_m[:, None] & em[None, :]
        x = tl.load(X + off[:, None] + src[None, :], mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(X + off[:, None] + src2[None, :], mask=m, other=0.0).to(tl.float32)
        cs = b * sc_b + tok[:, None] * sc_t + e[None, :]
        cos = tl.load(COS + cs, mask=m, other=0.0).to(tl.float32)
        sin = tl.load(SIN + cs, mask=m, other=0.0).to(tl.float32)
        return x * cos + tl.where((e < R // 2)[None, :], -x2, x2) * sin

    @triton.jit
    def _latent_scores(QL, qoff, rm, K, koff, km, W, inv, ROWS: tl.constexpr, N: tl.constexpr, C: tl.constexpr,
                       CK: tl.constexpr, NORM: tl.constexpr):
        """(ROWS, N) q_lat . latent of each query row (QL + qoff) and key (K + koff), summed over C in
        chunks of CK loaded as they are used: the queries held whole for a (ROWS, C) dot would take
        most of a thread's registers in every warp. NORM: the keys normed on the way (weight W,
        1 / rms `inv` (N, 1)), rounded as RMSNorm."""
        out = tl.zeros([ROWS, N], dtype=tl.float32)
        for c0 in tl.static_range(0, C, CK):
            cc = c0 + tl.arange(0, CK)
            q = tl.load(QL + qoff[:, None] + cc[None, :], mask=rm[:, None], other=0.0)
            k = tl.load(K + koff[:, None] + cc[None, :], mask=km[:, None], other=0.0)
            if NORM:
                k = (tl.load(W + cc).to(tl.float32)[None, :] * (k.to(tl.float32) * inv).to(k.dtype).to(tl.float32)).to(k.dtype)
            out += tl.dot(q, tl.trans(k))
        return out

    @triton.jit
    def mla_kernel(QL, QP, KV, W, eps, COS, SIN, CACHE, START, MASK, OUT, PM, PL, PO, scale, chunk, T, P,
                   sl_b, sl_t, sl_h, sp_b, sp_t, sp_h, skv_b, skv_t, sc_b, sc_s, s_start, sm_b, sm_t, sm_u,
                   so_b, so_t, scs_b, scs_t,
                   NH: tl.constexpr, C: tl.constexpr, R: tl.constexpr, RP: tl.constexpr, ROWS: tl.constexpr,
                   TP: tl.constexpr, PP: tl.constexpr, BLOCK: tl.constexpr, CK: tl.constexpr, TREE: tl.constexpr,
                   SPLIT: tl.constexpr, INTERLEAVED: tl.constexpr):
        b = tl.program_id(0)
        tile = tl.program_id(1)
        sp = tl.program_id(2)
        last = sp == tl.num_programs(2) - 1  # the split that also takes the pending and new entries
        start = tl.load(START + b * s_start).to(tl.int32)
        c = tl.arange(0, C)
        e = tl.arange(0, RP)
        em = e < R
        r = tile * ROWS + tl.arange(0, ROWS)  # query rows: token r // NH, head r % NH
        tq = r // NH
        hq = r % NH
        rm = tq < T
        qoff = b * sl_b + tq * sl_t + hq * sl_h
        qp = _rotated(QP, b * sp_b + tq * sp_t + hq * sp_h, tq, rm, COS, SIN, scs_b, scs_t, b, R, RP,
                      INTERLEAVED).to(QL.dtype.element_ty)
        row = CACHE + b * sc_b
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], dtype=tl.float32)
        acc = tl.zeros([ROWS, C], dtype=tl.float32)
        lo = sp * chunk
        hi = tl.minimum(lo + chunk, start - P)
        for s0 in range(lo, hi, BLOCK):  # cached entries, every one visible
            s = s0 + tl.arange(0, BLOCK)
            live = s < hi
            pe = tl.load(row + s[:, None] * sc_s + C + e[None, :], mask=live[:, None] & em[None, :], other=0.0)
            scores = _latent_scores(QL, qoff, rm, row, s * sc_s, live, W, eps, ROWS, BLOCK, C, CK, False)
            scores = (scores + tl.dot(qp, tl.trans(pe))) * scale
            lat = tl.load(row + s[:, None] * sc_s + c[None, :], mask=live[:, None], other=0.0)
            m_i, l_i, acc = fold(scores, live[None, :], lat, m_i, l_i, acc)
        if TREE:
            if last & (P > 0):  # the pending entries (a tree's earlier levels): what the mask allows
                j = tl.arange(0, PP)
                jm = j < P
                s = start - P + j
                pe = tl.load(row + s[:, None] * sc_s + C + e[None, :], mask=jm[:, None] & em[None, :], other=0.0)
                seen = tl.load(MASK + b * sm_b + tq[:, None] * sm_t + j[None, :] * sm_u,
                               mask=rm[:, None] & jm[None, :], other=0) != 0
                scores = _latent_scores(QL, qoff, rm, row, s * sc_s, jm, W, eps, ROWS, PP, C, CK, False)
                scores = (scores + tl.dot(qp, tl.trans(pe))) * scale
                lat = tl.load(row + s[:, None] * sc_s + c[None, :], mask=jm[:, None], other=0.0)
                m_i, l_i, acc = fold(scores, seen, lat, m_i, l_i, acc)
        if last:  # the new tokens: their entries, kv_a_layernorm(latent) (rounded as RMSNorm) and the rotated key
            u = tl.arange(0, TP)
            um = u < T
            x = tl.load(KV + b * skv_b + u[:, None] * skv_t + c[None, :], mask=um[:, None], other=0.0)
            xf = x.to(tl.float32)
            inv = tl.rsqrt(tl.sum(xf * xf, 1) / C + eps)[:, None]
            lat_new = (tl.load(W + c).to(tl.float32)[None, :] * (xf * inv).to(x.dtype).to(tl.float32)).to(x.dtype)
            kv_off = b * skv_b + u * skv_t
            pe_new = _rotated(KV + C, kv_off, u, um, COS, SIN, scs_b, scs_t, b, R, RP, INTERLEAVED).to(x.dtype)
            keep = tl.where(tile == 0, um, False)  # one writer per row (the others read none of them)
            tl.store(row + (start + u)[:, None] * sc_s + c[None, :], lat_new, mask=keep[:, None])
            tl.store(row + (start + u)[:, None] * sc_s + C + e[None, :], pe_new, mask=keep[:, None] & em[None, :])
            if TREE:
                seen = tl.load(MASK + b * sm_b + tq[:, None] * sm_t + (P + u)[None, :] * sm_u,
                               mask=rm[:, None] & um[None, :], other=0) != 0
            else:
                seen = (u[None, :] <= tq[:, None]) & um[None, :]
            scores = _latent_scores(QL, qoff, rm, KV, kv_off, um, W, inv, ROWS, TP, C, CK, True)
            scores = (scores + tl.dot(qp, tl.trans(pe_new))) * scale
            m_i, l_i, acc = fold(scores, seen, lat_new, m_i, l_i, acc)
        if SPLIT:
            part = (b * tl.num_programs(1) + tile) * tl.num_programs(2) + sp
            rr = tl.arange(0, ROWS)
            tl.store(PM + part * ROWS + rr, m_i)
            tl.store(PL + part * ROWS + rr, l_i)
            tl.store(PO + (part * ROWS + rr[:, None]) * C + c[None, :], acc)
        else:
            o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # padded rows: 0
            tl.store(OUT + b * so_b + tq[:, None] * so_t + hq[:, None] * C + c[None, :], o.to(OUT.dtype.element_ty),
                     mask=rm[:, None])
