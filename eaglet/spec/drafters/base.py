"""The drafter protocol: what the speculation loop asks of every drafter.

Rows of the batch are slots. The loop calls `start` when prompts are admitted into free rows
(on the device, inside the target's prefill graph) and `start_host` once the first tokens are on
the host; then per step `propose` (a tree rooted at each row's
last emitted token) and, after verification, `commit` with what was accepted, on the device,
followed by `commit_host` with the emitted tokens once they are on the host. A drafter keeps its
own state (caches, token history) consistent with the target's committed sequence.

`graphable` drafters keep all per-step state in persistent tensors and do only device work in
`propose` and `commit`, so both run inside the runtime's CUDA graphs.
"""
from __future__ import annotations

import copy
from typing import Protocol

import torch

from ...models.prefill import PromptBatch
from ...sampling import RowSampling
from ..tree import DraftProposal
from ..verify import VerifyResult


class Drafter(Protocol):
    taps: tuple[int, ...]  # target layers whose input residual stream the drafter reads; () if none
    graphable: bool

    def start(self, batch: PromptBatch, taps: torch.Tensor | None, first: torch.Tensor) -> None:
        """Free rows batch.rows got the prompts of `batch` (device, graph-safe), with the target's
        taps over them (b, T, k*H) or None, and each one's first sampled token (b,)."""

    def start_host(self, rows: list[int], prompts: list[list[int]], first: list[int]) -> None:
        """The same admission on the host."""

    def propose(self, roots: torch.Tensor, sampling: RowSampling) -> DraftProposal:
        """A draft tree for each row, rooted at roots (B,) (the last emitted tokens); a drafter
        that samples its drafts draws with each row's `sampling`."""

    def commit(self, prop: DraftProposal, res: VerifyResult, taps: torch.Tensor | None) -> None:
        """What the target accepted (device): res, and the verify forward's taps (B, N, k*H) or None."""

    def commit_host(self, emitted: list[list[int]]) -> None:
        """The same step's emitted tokens per row, on the host (accepted drafts then the bonus)."""

    def release(self, rows: list[int]) -> None:
        """The rows' sequences are gone; their state is free."""

    def rows(self, k: int) -> "Drafter":
        """The drafter over rows 0..k-1 only (sharing this one's state): what a step over the first
        k rows of the batch proposes with and commits to."""


def with_spec(drafter, spec):
    """A shallow copy of a drafter that drafts with another setting (chain or tree shape) over the same
    state: caches, pending block, token history. One drafter made with room for the widest of several
    settings serves them all, so a batch moves between them without a prefill (Engine.step)."""
    v = copy.copy(drafter)
    v.spec = spec
    return v


def row_view(drafter, k: int):
    """A shallow copy of a drafter over rows 0..k-1 (what `rows(k)` gives): its `row_tensors` and
    its `cache` (if it has one) sliced (views: writes land in the original's storage)."""
    v = copy.copy(drafter)
    for name in drafter.row_tensors:
        setattr(v, name, getattr(drafter, name)[:k])
    if getattr(drafter, "cache", None) is not None:
        v.cache = drafter.cache.view(0, k)
    return v


def start_rows(drafter: Drafter, rows: list[int], prompts: list[list[int]], taps: torch.Tensor | None,
               first: torch.Tensor) -> None:
    """Admit prompts into a drafter outside the decoder (tools, tests): start and start_host.
    taps are over the prompts right-padded to the longest."""
    dev = first.device
    drafter.start(PromptBatch.of(prompts, rows, dev, t=None if taps is None else taps.shape[1]), taps, first)
    drafter.start_host(rows, prompts, first.tolist())
