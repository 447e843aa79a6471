"""The drafter protocol: what the speculation loop asks of every drafter.

The loop calls `start` once after the target's prefill, then per step `propose` (a tree rooted at
the last emitted token) and, after verification, `commit` with what was accepted. A drafter keeps
its own state (caches, token history) consistent with the target's committed sequence.
"""
from __future__ import annotations

from typing import Protocol

import torch

from ..tree import DraftProposal
from ..verify import VerifyResult


class Drafter(Protocol):
    taps: tuple[int, ...]  # target layers whose input residual stream the drafter reads; () if none

    def start(self, prompts: list[list[int]], taps: torch.Tensor | None, first: torch.Tensor) -> None:
        """After the target's prefill: prompts (host), the target's taps over the right-padded
        prompts (B, T, k*H) or None, and the first sampled token of each sequence (B,)."""

    def propose(self, roots: torch.Tensor) -> DraftProposal:
        """A draft tree for each sequence, rooted at roots (B,) (the last emitted tokens)."""

    def commit(self, prop: DraftProposal, res: VerifyResult, taps: torch.Tensor | None,
               emitted: list[list[int]]) -> None:
        """What the target accepted: res (device), the verify forward's taps (B, N, k*H) or None,
        and the emitted tokens per sequence on the host (accepted drafts then the bonus)."""
