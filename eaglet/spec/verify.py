"""Acceptance: which drafted nodes the target agrees with, and the bonus token. Pure functions of
the proposal and the target's outputs; imports nothing from the engine (but the compile switch).

The longest root-to-leaf path whose every token is the target's token after its parent, then the
target's token after the last accepted node (the bonus). The target's token after a node is its
argmax for a greedy row and, for a sampled row, its draw at that position (sampling.RowSampling.
pick: Gumbel-max with noise keyed by the row's stream and the position). The draw at a position is
the one plain sampling makes there, so the emitted tokens are exactly plain sampling's: lossless
whatever the drafter proposed, and the acceptance of a node's children is the target's probability
of their tokens, as in SpecInfer's sampling for deterministic drafts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import EAGER, Kernels, fusable
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
