"""Acceptance: which drafted nodes the target agrees with, and the bonus token. Pure functions of
the proposal and the target's outputs; imports nothing from the engine (but the compile switch).

- greedy: the longest root-to-leaf path whose every token is the target's argmax at its parent,
  then the target's argmax after the last accepted node (the bonus).
- sampling (lossless): at each accepted node, try its children in order. A child x drafted from q
  is accepted with probability min(1, p(x)/q(x)); on rejection p <- normalize(max(p - q, 0)) and
  the next sibling is tried. Deterministic drafts (trees, n-gram) have q = one-hot(x), which makes
  this "accept with p(x), else zero p(x) and renormalize". When no child is accepted the bonus is
  drawn from what remains of p (Leviathan et al. 2023; SpecInfer for trees).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import EAGER, Kernels, fusable
from ..sampling import ACCEPT, BONUS, sample_probs, uniform
from .tree import DraftProposal


@dataclass
class VerifyResult:
    path: torch.Tensor  # (B, D+1) accepted node indices, root first; entries past `count` are 0
    count: torch.Tensor  # (B,) accepted nodes including the root = tokens emitted this step
    tokens: torch.Tensor  # (B, D+1) emitted tokens: accepted drafts, then the bonus; padding past count
    bonus: torch.Tensor  # (B,) the last emitted token, the next root


def cut(count: torch.Tensor, tokens: torch.Tensor, most: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Emit at most most[b] tokens per row (0 freezes a finished row): the accepted count cut, and
    the bonus (the next root) the last token kept. No sync."""
    count = torch.minimum(count, most)
    return count, tokens.gather(1, (count - 1).clamp(min=0)[:, None])[:, 0]


def _finish(prop: DraftProposal, path: list[torch.Tensor], count: torch.Tensor, bonus: torch.Tensor) -> VerifyResult:
    return VerifyResult(*emitted_path(prop.tokens, torch.stack(path, 1), count, bonus))


def emitted_path(tokens: torch.Tensor, path: torch.Tensor, count: torch.Tensor, bonus: torch.Tensor):
    """VerifyResult's fields from the accepted path (B, D+1) of node indices, root first."""
    drafted = tokens.gather(1, path)  # (B, D+1): root, then accepted drafts
    emitted = torch.cat([drafted[:, 1:], drafted[:, :1]], 1)  # shift left: drafts after the root
    ar = torch.arange(path.shape[1], device=path.device)[None]
    emitted = torch.where(ar == (count - 1)[:, None], bonus[:, None], emitted)
    return path, count, emitted, bonus


def greedy_verify(prop: DraftProposal, target_argmax: torch.Tensor, max_depth: int,
                  kernels: Kernels = EAGER) -> VerifyResult:
    """target_argmax (B, N): the target's argmax next token at every node."""
    return VerifyResult(*kernels.fuse(greedy_accept)(prop.tokens, prop.parents, prop.valid, target_argmax, max_depth))


@fusable
def greedy_accept(tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor, target_argmax: torch.Tensor,
                  max_depth: int):
    b = tokens.shape[0]
    dev = tokens.device
    cur = torch.zeros(b, dtype=torch.long, device=dev)
    alive = torch.ones(b, dtype=torch.bool, device=dev)
    count = torch.ones(b, dtype=torch.long, device=dev)
    path = [cur]
    for _ in range(max_depth):
        want = target_argmax.gather(1, cur[:, None])  # (B, 1)
        match = (parents == cur[:, None]) & (tokens == want) & valid  # (B, N)
        ok = match.any(1) & alive
        nxt = match.to(torch.uint8).argmax(1)  # first matching child
        cur = torch.where(ok, nxt, cur)
        path.append(torch.where(ok, nxt, torch.zeros_like(nxt)))
        count = count + ok
        alive = ok
    return emitted_path(tokens, torch.stack(path, 1), count, target_argmax.gather(1, cur[:, None])[:, 0])


def sample_verify(prop: DraftProposal, p: torch.Tensor, max_depth: int, max_children: int,
                  generator=None, kernels: Kernels = EAGER) -> VerifyResult:
    """p (B, N, V): the target's (temperature/top-k/top-p adjusted) distribution at every node.
    generator: where the random numbers come from (sampling.uniform: a RowSampling's per-row
    streams, a torch.Generator, or None)."""
    b, n, v = p.shape
    draws = uniform(generator, (b, max_depth * max_children), p.device, ACCEPT)  # every trial's, in one draw
    if prop.q is not None:
        return _sample_verify_q(prop, p, max_depth, max_children, generator, draws)
    # deterministic drafts: each trial needs only its token's probability under its parent's p
    pc = p.reshape(b, n * v).gather(1, prop.parents.clamp(min=0) * v + prop.tokens)  # (B, N)
    path, count, cur, dropped = kernels.fuse(tree_sample_accept)(prop.tokens, prop.parents, prop.valid, pc, draws,
                                                                 max_depth, max_children)
    last = p[torch.arange(b, device=p.device), cur]  # (B, V) p at the last accepted node
    bad = torch.zeros_like(last).scatter_add_(1, prop.tokens, dropped.to(last.dtype)) > 0
    left = last.masked_fill(bad, 0)  # its rejected children's tokens zeroed (the race needs no normalizing)
    left = torch.where(left.sum(-1, keepdim=True) > 0, left, last)
    return VerifyResult(*emitted_path(prop.tokens, path, count, sample_probs(left, generator, BONUS)))


@fusable
def tree_sample_accept(tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor, pc: torch.Tensor,
                       draws: torch.Tensor, max_depth: int, max_children: int):
    """The acceptance walk over a deterministic draft (q one-hot): at the current node its children
    are tried in order, child x accepted with probability p(x) / (1 - the mass of the children
    rejected before it) (what is left of p, renormalized: Leviathan et al. with q = one-hot(x)),
    a token already rejected there counting 0. pc (B, N): each node's token's probability under
    its parent's p; draws (B, max_depth * max_children) uniforms. Returns the path (B, D+1), the
    count (B,), the last accepted node (B,) and the nodes rejected there (B, N) bool."""
    b, n = tokens.shape
    dev = tokens.device
    cur = torch.zeros(b, dtype=torch.long, device=dev)
    alive = torch.ones(b, dtype=torch.bool, device=dev)
    count = torch.ones(b, dtype=torch.long, device=dev)
    rejected = torch.zeros(b, n, dtype=torch.bool, device=dev)
    path = [cur]
    for depth in range(max_depth):
        here = parents == cur[:, None]  # (B, N)
        children = here & valid & alive[:, None]
        rank = children.long().cumsum(1) - 1
        moved = torch.zeros(b, dtype=torch.bool, device=dev)
        mass = torch.zeros(b, dtype=pc.dtype, device=dev)  # of the children rejected at this node
        for r in range(max_children):
            sel = children & (rank == r)
            has = sel.any(1) & ~moved
            child = sel.to(torch.uint8).argmax(1)  # (B,)
            x = tokens.gather(1, child[:, None])  # (B, 1)
            seen = (rejected & here & (tokens == x)).any(1)  # its token was rejected here already
            px = torch.where(seen, torch.zeros_like(mass), pc.gather(1, child[:, None])[:, 0])
            accept = has & (draws[:, depth * max_children + r] * (1 - mass) < px)
            reject = has & ~accept
            mass = mass + torch.where(reject, px, torch.zeros_like(px))
            rejected = rejected | (sel & reject[:, None])
            moved = moved | accept
            cur = torch.where(accept, child, cur)
        path.append(torch.where(moved, cur, torch.zeros_like(cur)))
        count = count + moved
        alive = moved
    return torch.stack(path, 1), count, cur, rejected & (parents == cur[:, None])


def _sample_verify_q(prop: DraftProposal, p: torch.Tensor, max_depth: int, max_children: int, generator,
                     draws: torch.Tensor) -> VerifyResult:
    """sample_verify for a draft sampled from the drafter's q (prop.q (B, N, V)): the residual
    max(p - q, 0), renormalized, carried over the vocabulary."""
    b, n, v = p.shape
    dev = p.device
    rows = torch.arange(b, device=dev)
    cur = torch.zeros(b, dtype=torch.long, device=dev)
    alive = torch.ones(b, dtype=torch.bool, device=dev)
    count = torch.ones(b, dtype=torch.long, device=dev)
    residual = p[:, 0].clone()  # (B, V) what is left of p at the current node
    path = [cur]
    for depth in range(max_depth):
        children = (prop.parents == cur[:, None]) & prop.valid & alive[:, None]  # (B, N)
        rank = children.cumsum(1) - 1
        moved = torch.zeros(b, dtype=torch.bool, device=dev)
        for r in range(max_children):
            sel = children & (rank == r)
            has = sel.any(1) & ~moved
            child = sel.to(torch.uint8).argmax(1)  # (B,)
            x = prop.tokens[rows, child]  # (B,)
            q = prop.q[rows, cur]  # (B, V)
            px, qx = residual[rows, x], q[rows, x]
            u = draws[:, depth * max_children + r]
            accept = has & (u * qx < px)  # u < min(1, p/q) without dividing by zero
            reject = has & ~accept
            left = (residual - q).clamp(min=0)
            total = left.sum(-1, keepdim=True)
            left = torch.where(total > 0, left / total.clamp(min=1e-30), residual)
            residual = torch.where(reject[:, None], left, residual)
            moved |= accept
            cur = torch.where(accept, child, cur)
        path.append(torch.where(moved, cur, torch.zeros_like(cur)))
        count += moved
        residual = torch.where(moved[:, None], p[rows, cur], residual)  # fresh p at the new node
        alive = moved
    return _finish(prop, path, count, sample_probs(residual, generator, BONUS))
