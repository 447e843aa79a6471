"""The router's choice for a few tokens as one Triton kernel: from the router's float32 logits to each
token's top-k experts and routing weights, everything SparseMoE.route does in torch (softmax or
sigmoid scores, the learned bias on the choice, the best groups first, renormalization, scaling)
in one program per token instead of a dozen small kernels. Experts come out best first, as
torch.topk orders them. Used beside the fused expert kernels (Kernels.moe) for 1 to 64 tokens;
under TRITON_INTERPRET=1 (the CPU tests) it runs on any device.
"""
from __future__ import annotations

import torch

from ..config import MoEConfig
from .fused_moe import triton

if triton is not None:
    import triton.language as tl


def route(logits: torch.Tensor, cfg: MoEConfig, bias: torch.Tensor | None,
          spread: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (N, E), read in float32 -> (weights (N, k) float32, experts (N, k) int64); `spread`:
    the logits scrambled first (SparseMoE.route_spread)."""
    n, e = logits.shape
    k = cfg.top_k
    weights = torch.empty(n, k, dtype=torch.float32, device=logits.device)
    experts = torch.empty(n, k, dtype=torch.int64, device=logits.device)
    route_kernel[(n,)](logits, logits if bias is None else bias, experts, weights, e, e // cfg.n_group,
                       logits.stride(0), float(cfg.scaling),
                       EP=triton.next_power_of_2(e), K=k, KP=triton.next_power_of_2(k),
                       GP=triton.next_power_of_2(cfg.n_group), GROUPS=cfg.n_group, TOPK_GROUP=cfg.topk_group,
                       SIGMOID=cfg.scoring == "sigmoid", BIAS=bias is not None, GROUP_TOP2=cfg.group_top2,
                       NORM=cfg.norm_topk_prob, SPREAD=spread)
    return weights, experts


if triton is not None:
    @triton.jit
    def route_kernel(logits, bias, experts, weights, E, PER, sl, scaling,
                     EP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, GP: tl.constexpr,
                     GROUPS: tl.constexpr, TOPK_GROUP: tl.constexpr, SIGMOID: tl.constexpr, BIAS: tl.constexpr,
                     GROUP_TOP2: tl.constexpr, NORM: tl.constexpr, SPREAD: tl.constexpr):
        t = tl.program_id(0)
        e = tl.arange(0, EP)
        valid = e < E
        x = tl.load(logits + t * sl + e, mask=valid, other=0.0).to(tl.float32)
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
