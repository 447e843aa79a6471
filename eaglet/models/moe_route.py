"""The router's choice for a few tokens as one Triton kernel: from the token's hidden state to its
top-k experts and routing weights, everything SparseMoE.route does in torch (the router's logits,
softmax or sigmoid scores, the learned bias on the choice, the best groups first, renormalization,
scaling) in one kernel instead of a GEMM (three kernels where the router runs in float32: a cast,
a dot and its reduction) and a dozen small ones. Experts come out best first, as torch.topk orders
them. Used beside the fused expert kernels (Kernels.moe) for 1 to 64 tokens; under
TRITON_INTERPRET=1 (the CPU tests) it runs on any device.

`router`: programs (expert block, token) each compute a few experts' logits of one token (a
router's weights are 0.5 to 11 MB: one program alone would stream them from one SM), store them,
and count themselves done on the token's counter; the last of a token's programs to finish reads
the token's logits back and routes it, then zeroes the counter for the next call (a CUDA graph
replays the same counters). A logit sums its row in one fixed order whatever the token count.

`route_normed`: the same, with the layer's post-attention RMSNorm and its residual add done first by
every program (a token's 2 x H inputs come from L2; the norm's own kernel and its launch are gone);
the first program of each token stores the normed input, which the expert kernels then read, and the
new residual stream. Taken for decode's one or two tokens (moe.NORM_TOKENS), where it pays.
"""
from __future__ import annotations

import torch

from ..config import MoEConfig
from .cache_attention import dependent_launch
from .fused_moe import triton

if triton is not None:
    import triton.language as tl


def router_tiles(e: int, h: int) -> tuple[int, int]:
    """(experts a program, the H step): 64 to 256 programs a token (one expert each up to 256 experts)."""
    return max(1, min(8, triton.next_power_of_2(e) // 256)), min(1024, triton.next_power_of_2(h))


def router(x: torch.Tensor, weight: torch.Tensor, cfg: MoEConfig, bias: torch.Tensor | None,
           counts: torch.Tensor, spread: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x (N, H), the router's weight (E, H) in float32 or x's dtype (logits then rounded to it, as a
    matmul in that dtype would), counts (>= N,) int32 zeros, zero again after -> (weights (N, k)
    float32, experts (N, k) int64)."""
    return _route(x, None, weight, cfg, bias, counts, spread)[2:]


def route_normed(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                 weight: torch.Tensor, cfg: MoEConfig, bias: torch.Tensor | None, counts: torch.Tensor,
                 spread: bool = False) -> tuple[torch.Tensor, ...]:
    """`router` of RMSNorm(x + residual) (llama.RMSNorm with its residual add: the sum rounded to x's
    dtype, float32 statistics, the normed value rounded, then times the norm's weight) -> (the normed
    input (N, H), the stream x + residual (N, H), weights, experts)."""
    return _route(x, (residual, norm_weight, eps), weight, cfg, bias, counts, spread)


def _route(x: torch.Tensor, prenorm: tuple | None, weight: torch.Tensor, cfg: MoEConfig, bias: torch.Tensor | None,
           counts: torch.Tensor, spread: bool) -> tuple[torch.Tensor, ...]:
    n, h = x.shape
    e, k = weight.shape[0], cfg.top_k
    if x.stride(1) != 1:
        x = x.contiguous()
    logits = torch.empty(n, e, dtype=torch.float32, device=x.device)
    weights = torch.empty(n, k, dtype=torch.float32, device=x.device)
    experts = torch.empty(n, k, dtype=torch.int64, device=x.device)
    normed = stream = residual = norm_weight = x  # not read without prenorm
    eps = 0.0
    if prenorm is not None:
        residual, norm_weight, eps = prenorm
        residual = residual.reshape(n, h).contiguous()
        normed, stream = (torch.empty(n, h, dtype=x.dtype, device=x.device) for _ in range(2))
    be, bk = router_tiles(e, h)
    # Launched dependent on the kernel before: at one token the o projection's GEMV, which lets it start
    # early; after any other kernel (a tile GEMM, an all-reduce) it starts once that one completes
    gdc = prenorm is not None and dependent_launch(x)
    router_kernel[(triton.cdiv(e, be), n)](
        x, residual, norm_weight, normed, stream, float(eps),
        weight, weight if bias is None else bias, logits, counts, experts, weights, e, h, e // cfg.n_group,
        x.stride(0), float(cfg.scaling), GDC=gdc, PRENORM=prenorm is not None, BE=be, BK=bk,
        ROUND=weight.dtype != torch.float32,
        EP=triton.next_power_of_2(e), K=k, KP=triton.next_power_of_2(k), GP=triton.next_power_of_2(cfg.n_group),
        GROUPS=cfg.n_group, TOPK_GROUP=cfg.topk_group, SIGMOID=cfg.scoring == "sigmoid", BIAS=bias is not None,
        GROUP_TOP2=cfg.group_top2, NORM=cfg.norm_topk_prob, SPREAD=spread, num_warps=4,
        **({"launch_pdl": True} if gdc else {}))
    return normed, stream, weights, experts


if triton is not None:
    @triton.jit
    def rms_scaled(s, inv, nw, dt: tl.constexpr):
        """RMSNorm's output (llama.rms_norm) from the stream s and 1 / rms, in float32: s * inv rounded
        to dt, times the norm's weight nw, rounded to dt."""
        return ((s * inv).to(dt).to(tl.float32) * nw.to(tl.float32)).to(dt).to(tl.float32)

    @triton.jit
    def stream_at(X, R, t, sx, kk, km, H):
        """Token t's x + residual at columns kk, rounded to x's dtype as the add in that dtype, in float32."""
        a = tl.load(X + t * sx + kk, mask=km, other=0.0)
        b = tl.load(R + t * H + kk, mask=km, other=0.0)
        return (a.to(tl.float32) + b.to(tl.float32)).to(a.dtype).to(tl.float32)

    @triton.jit
    def route_step(acc, X, R, NW, XN, XS, t, sx, kk, H, inv, w, PRENORM: tl.constexpr):
        """acc + w * the input at columns kk: x, or with PRENORM RMSNorm(x + residual) as llama.RMSNorm
        gives it (the normed value rounded to x's dtype, then times the norm's weight), which the first
        program of the token stores with the stream."""
        km = kk < H
        if PRENORM:
            s = stream_at(X, R, t, sx, kk, km, H)
            dt = XN.dtype.element_ty
            x = rms_scaled(s, inv, tl.load(NW + kk, mask=km, other=0.0), dt)
            if tl.program_id(0) == 0:  # the expert kernels read the normed input, the next layer the stream
                tl.store(XN + t * H + kk, x.to(dt), mask=km)
                tl.store(XS + t * H + kk, s.to(dt), mask=km)
        else:
            x = tl.load(X + t * sx + kk, mask=km, other=0.0).to(tl.float32)
        return acc + w.to(tl.float32) * x[None, :]

    @triton.jit
    def router_kernel(X, R, NW, XN, XS, eps, W, bias, logits, counts, experts, weights, E, H, PER, sx, scaling,
                      GDC: tl.constexpr, PRENORM: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr, ROUND: tl.constexpr,
                      EP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, GP: tl.constexpr,
                      GROUPS: tl.constexpr, TOPK_GROUP: tl.constexpr, SIGMOID: tl.constexpr, BIAS: tl.constexpr,
                      GROUP_TOP2: tl.constexpr, NORM: tl.constexpr, SPREAD: tl.constexpr):
        t = tl.program_id(1)
        rows = tl.program_id(0) * BE + tl.arange(0, BE)
        rm = rows < E
        if GDC:  # launched dependent on the kernel before: the router's weights do not depend on it, so
            # its first step's are read while it finishes, then its output awaited
            kk = tl.arange(0, BK)
            w0 = tl.load(W + rows[:, None] * H + kk[None, :], mask=rm[:, None] & (kk < H)[None, :], other=0.0)
            tl.extra.cuda.gdc_wait()
        inv = 1.0
        if PRENORM:  # 1 / rms of the stream x + residual, in every program
            sq = tl.zeros((BK,), dtype=tl.float32)
            for k0 in range(0, H, BK):
                kk = k0 + tl.arange(0, BK)
                s = stream_at(X, R, t, sx, kk, kk < H, H)
                sq += s * s
            inv = tl.math.rsqrt(tl.sum(sq, 0) / H + eps)
        acc = tl.zeros((BE, BK), dtype=tl.float32)
        if GDC:  # the first step, its weights read before the wait
            acc = route_step(acc, X, R, NW, XN, XS, t, sx, tl.arange(0, BK), H, inv, w0, PRENORM)
        for k0 in range(GDC * BK, H, BK):
            kk = k0 + tl.arange(0, BK)
            w = tl.load(W + rows[:, None] * H + kk[None, :], mask=rm[:, None] & (kk < H)[None, :], other=0.0)
            acc = route_step(acc, X, R, NW, XN, XS, t, sx, kk, H, inv, w, PRENORM)
        lg = tl.sum(acc, 1)
        if ROUND:  # as the matmul in the weight's dtype rounds its output
            lg = lg.to(W.dtype.element_ty).to(tl.float32)
        tl.store(logits + t * E + rows, lg, mask=rm)
        # release: this program's logits visible before its count; the last one acquires all of them
        if tl.atomic_add(counts + t, 1, sem="acq_rel") == tl.num_programs(0) - 1:
            e = tl.arange(0, EP)
            x = tl.load(logits + t * E + e, mask=e < E, other=0.0, cache_modifier=".cg")
            _choose(x, bias, experts, weights, t, E, PER, scaling, EP, K, KP, GP, GROUPS, TOPK_GROUP, SIGMOID,
                    BIAS, GROUP_TOP2, NORM, SPREAD)
            tl.atomic_xchg(counts + t, 0)

    @triton.jit
    def _choose(x, bias, experts, weights, t, E, PER, scaling,
                EP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, GP: tl.constexpr,
                GROUPS: tl.constexpr, TOPK_GROUP: tl.constexpr, SIGMOID: tl.constexpr, BIAS: tl.constexpr,
                GROUP_TOP2: tl.constexpr, NORM: tl.constexpr, SPREAD: tl.constexpr):
        """Token t's top-k experts and weights from its float32 logits x (EP,)."""
        e = tl.arange(0, EP)
        valid = e < E
        if SPREAD:
            x = tl.sin(x * 1e4)
        x = tl.where(valid, x, float("-inf"))
        if SIGMOID:
            s = 1.0 / (1.0 + tl.exp(-x))
        else:
            p = tl.exp(x - tl.max(x, 0))
            s = p / tl.sum(p, 0)
        s = tl.where(valid, s, 0.0)
        choice = s
        if BIAS:
            choice = s + tl.load(bias + e, mask=valid, other=0.0)
        choice = tl.where(valid, choice, float("-inf"))
        if GROUPS > 1:  # keep the experts of the TOPK_GROUP best groups
            g = tl.arange(0, GP)
            member = ((e[None, :] // PER) == g[:, None]) & valid[None, :]  # (GP, EP)
            inside = tl.where(member, choice[None, :], float("-inf"))
            best = tl.max(inside, 1)
            if GROUP_TOP2:  # a group's score: its best two experts' sum
                first = tl.argmax(inside, 1)
                second = tl.max(tl.where(e[None, :] == first[:, None], float("-inf"), inside), 1)
                best = best + second
            best = tl.where(g < GROUPS, best, float("-inf"))
            keep = tl.zeros((GP,), dtype=tl.int32)
            for _ in tl.static_range(TOPK_GROUP):
                pick = tl.argmax(best, 0)
                keep = tl.where(g == pick, 1, keep)
                best = tl.where(g == pick, float("-inf"), best)
            kept = tl.sum(tl.where(member, keep[:, None], 0), 0) > 0
            choice = tl.where(kept, choice, float("-inf"))
        slots = tl.arange(0, KP)
        chosen = tl.zeros((KP,), dtype=tl.int64)
        w = tl.zeros((KP,), dtype=tl.float32)
        for j in tl.static_range(K):  # best first, the lowest index among equals
            pick = tl.argmax(choice, 0)
            chosen = tl.where(slots == j, pick.to(tl.int64), chosen)
            w = tl.where(slots == j, tl.sum(tl.where(e == pick, s, 0.0), 0), w)
            choice = tl.where(e == pick, float("-inf"), choice)
        if NORM:
            w = w / (tl.sum(w, 0) + 1e-20)
        tl.store(experts + t * K + slots, chosen, mask=slots < K)
        tl.store(weights + t * K + slots, w * scaling, mask=slots < K)
