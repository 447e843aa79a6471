"""Draft trees as tensors: the proposal contract, ancestor masks, and the EAGLE-2 selection of the
best nodes by cumulative log-probability. Pure tensor functions; nothing here runs a model.

Node 0 of every proposal is the root: the last emitted token, not yet in the target's cache.
Nodes are ordered parents before children, so a node's index is always larger than its parent's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import EAGER, Kernels, fusable
from .topk import topk


@dataclass
class DraftProposal:
    tokens: torch.Tensor  # (B, N) target-vocabulary ids; column 0 is the root
    parents: torch.Tensor  # (B, N) index of each node's parent; -1 for the root
    depth: torch.Tensor  # (B, N) 0 for the root
    mask: torch.Tensor  # (B, N, N) bool: node i attends to node j (j is i or an ancestor of i)
    valid: torch.Tensor  # (B, N) bool: False for padding nodes (never accepted)
    score: torch.Tensor | None = None  # (B, N) cumulative draft log-probability (trees; the profiler
    #                                     predicts smaller budgets from it)

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    @staticmethod
    def from_parents(tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor | None = None,
                     max_depth: int | None = None, kernels: Kernels = EAGER) -> "DraftProposal":
        mask, depth = kernels.fuse(ancestor_mask)(parents, max_depth)
        if valid is None:
            valid = torch.ones_like(tokens, dtype=torch.bool)
        return DraftProposal(tokens, parents, depth, mask, valid)


@fusable
def ancestor_mask(parents: torch.Tensor, max_depth: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """parents (B, N) -> (mask (B, N, N) self-or-ancestor, depth (B, N)). No host sync. Its loop
    is ~10 kernels per level eagerly; compiled on the GPU, one or two in all."""
    b, n = parents.shape
    mask = torch.eye(n, dtype=torch.bool, device=parents.device).expand(b, n, n).clone()
    depth = torch.zeros_like(parents)
    cur = parents
    for _ in range(n - 1 if max_depth is None else max_depth):
        live = cur >= 0  # (B, N)
        mask |= torch.nn.functional.one_hot(cur.clamp(min=0), n).bool() & live[..., None]
        depth = depth + live
        cur = torch.where(live, parents.gather(1, cur.clamp(min=0)), cur)
    return mask, depth


def chain(tokens: torch.Tensor, valid: torch.Tensor | None = None) -> DraftProposal:
    """A chain root -> d1 -> ... -> dk from tokens (B, k+1) (column 0 = root). Node i's ancestors
    are 0..i-1 and its depth is i, so no ancestor_mask loop: a few kernels in each graphed draft
    phase instead of ~50."""
    b, n = tokens.shape
    ar = torch.arange(n, device=tokens.device)
    valid = torch.ones_like(tokens, dtype=torch.bool) if valid is None else valid
    return DraftProposal(tokens, (ar - 1).expand(b, n), ar.expand(b, n), (ar[:, None] >= ar).expand(b, n, n), valid)


def select_tree(roots: torch.Tensor, cand_tokens: torch.Tensor, cand_parents: torch.Tensor,
                cand_scores: torch.Tensor, num_nodes: int, max_depth: int, kernels: Kernels = EAGER) -> DraftProposal:
    """Keep the best `num_nodes - 1` candidates by cumulative log-probability (EAGLE-2).

    cand_* are (B, C), generated level by level so a parent's index is below its children's;
    cand_parents indexes candidates, -1 meaning the root. A child's score never exceeds its
    parent's, and ties are broken toward lower candidate ids (parents, shallower nodes) by a
    stable sort, so the kept set is a connected tree. (An epsilon times depth is not enough: in
    float32 it rounds away once |score| > ~16, and topk orders exact ties arbitrarily.)
    Depths come from the kept parents (ancestor_mask), so the candidates carry none.
    """
    best = topk(cand_scores, num_nodes - 1, stable=True, kernel=kernels.topk)[1]  # ties: lower id first
    tokens, parents, depth, mask, score = kernels.fuse(kept_tree)(best, roots, cand_tokens, cand_parents,
                                                                  cand_scores, max_depth)
    return DraftProposal(tokens, parents, depth, mask, torch.ones_like(tokens, dtype=torch.bool), score=score)


@fusable
def kept_tree(best: torch.Tensor, roots: torch.Tensor, cand_tokens: torch.Tensor, cand_parents: torch.Tensor,
              cand_scores: torch.Tensor, max_depth: int):
    """select_tree's proposal from its kept candidates `best` (B, K): tokens (root first), parents,
    depth, ancestor mask and score, in parent order."""
    b, c = cand_tokens.shape
    keep = best.shape[1]
    idx = best.sort(-1).values  # (B, K) candidate ids, parent order
    new_pos = torch.full((b, c), -1, dtype=torch.long, device=cand_tokens.device)
    new_pos.scatter_(1, idx, torch.arange(1, keep + 1, device=idx.device).expand(b, keep))
    par = cand_parents.gather(1, idx)  # (B, K) candidate ids of parents, -1 root
    par_new = torch.where(par >= 0, new_pos.gather(1, par.clamp(min=0)), torch.zeros_like(par))
    tokens = torch.cat([roots[:, None], cand_tokens.gather(1, idx)], 1)  # (B, N)
    parents = torch.cat([torch.full_like(roots[:, None], -1), par_new], 1)
    mask, depth = ancestor_mask(parents, max_depth)  # traced into this function's compiled body
    score = torch.cat([torch.zeros_like(cand_scores[:, :1]), cand_scores.gather(1, idx)], 1)
    return tokens, parents, depth, mask, score
