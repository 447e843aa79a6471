"""Speculation metrics, named like vLLM's: drafts (verify steps), draft tokens, accepted tokens,
accepted tokens per draft position; accept length τ counts the bonus token (docs/eagle3.md)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class SpecMetrics:
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0  # drafted tokens accepted (bonus not counted)
    accepted_per_pos: list[int] = field(default_factory=list)  # position i (1-based depth) accepted
    drafts_reaching_pos: list[int] = field(default_factory=list)  # drafts that proposed depth i

    def merge(self, other: "SpecMetrics") -> None:
        self.drafts += other.drafts
        self.draft_tokens += other.draft_tokens
        self.accepted_tokens += other.accepted_tokens
        n = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        pad = lambda xs: xs + [0] * (n - len(xs))  # noqa: E731
        self.accepted_per_pos = [a + b for a, b in zip(pad(self.accepted_per_pos), pad(other.accepted_per_pos))]
        self.drafts_reaching_pos = [a + b for a, b in zip(pad(self.drafts_reaching_pos),
                                                          pad(other.drafts_reaching_pos))]

    @property
    def accept_length(self) -> float:
        """τ: tokens emitted per verify step, bonus included (1.0 when nothing was drafted)."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        return [a / r if r else 0.0 for a, r in zip(self.accepted_per_pos, self.drafts_reaching_pos)]

    def to_dict(self) -> dict:
        return {"drafts": self.drafts, "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                "accept_length": self.accept_length, "accepted_per_pos": self.accepted_per_pos,
                "acceptance_rate_per_pos": self.acceptance_rate_per_pos}


class RowCounters:
    """The SpecMetrics of every row of a batch, as arrays, so a step's records for all its rows
    are a few array operations instead of a Python update of each row's lists (the server's host
    path at 64 rows). A step's record is kept as it came and folded into the arrays, with the
    records of the other steps since, when something reads them. A row's counters start at 0 when
    a request takes it (`reset`)."""

    def __init__(self, batch: int, depth: int):
        self.totals = np.zeros((batch, 3), dtype=np.int64)  # drafts, draft tokens, accepted tokens
        self.accepted = np.zeros((batch, depth), dtype=np.int64)  # [row, i]: accepted at depth i + 1
        self.reaching = np.zeros((batch, depth), dtype=np.int64)  # [row, i]: drafts that proposed depth i + 1
        self.pos = np.arange(depth)
        self.pending: list[np.ndarray] = []  # records not folded yet: (n, 4) rows, accepted, drafted, depth
        self.since = np.zeros(3, dtype=np.int64)  # sums since `take`: drafts, draft tokens, accepted tokens
        self.since_pos = np.zeros((2, depth), dtype=np.int64)  # and per position: accepted, reaching

    def reset(self, rows: list[int]) -> None:
        self._fold()
        for a in (self.totals, self.accepted, self.reaching):
            a[rows] = 0

    def record(self, rows: list[int], accepted: np.ndarray, draft_tokens: np.ndarray, max_depth: np.ndarray) -> None:
        """One draft of each of `rows`: `accepted` drafted tokens taken (so positions 1..accepted
        count one), `draft_tokens` drafted, positions 1..max_depth reached."""
        self.pending.append(np.stack([np.asarray(rows), accepted, draft_tokens, max_depth], 1))

    def _fold(self) -> None:
        if not self.pending:
            return
        one = len(self.pending) == 1  # one step's record: each row once
        rows, accepted, draft_tokens, max_depth = (self.pending[0] if one else np.concatenate(self.pending)).T
        self.pending.clear()
        acc = accepted[:, None] > self.pos  # (n, depth)
        reach = max_depth[:, None] > self.pos
        totals = np.stack([np.ones_like(accepted), draft_tokens, accepted], 1)
        if one:  # rows unique: plain indexing (np.add.at, for repeated rows, is many times slower)
            self.totals[rows] += totals
            self.accepted[rows] += acc
            self.reaching[rows] += reach
        else:
            np.add.at(self.totals, rows, totals)
            np.add.at(self.accepted, rows, acc.astype(np.int64))
            np.add.at(self.reaching, rows, reach.astype(np.int64))
        self.since += len(rows), draft_tokens.sum(), accepted.sum()
        self.since_pos += acc.sum(0), reach.sum(0)

    def take(self) -> SpecMetrics:
        """The sum of every draft recorded since the last call, over all rows."""
        self._fold()
        out = SpecMetrics(*self.since.tolist(), *trimmed(*self.since_pos))
        self.since[:], self.since_pos[:] = 0, 0
        return out

    def of(self, row: int) -> SpecMetrics:
        """One row's counters."""
        self._fold()
        drafts, tokens, accepted = (int(x) for x in self.totals[row])
        return SpecMetrics(drafts, tokens, accepted, *trimmed(self.accepted[row], self.reaching[row]))

    def every(self) -> list[SpecMetrics]:
        """Every row's counters, as `of` gives them, from a few array operations (a batch of 20k
        rows would spend seconds in `of` row by row)."""
        self._fold()
        nz = (self.accepted != 0) | (self.reaching != 0)
        depth = np.where(nz.any(1), nz.shape[1] - np.argmax(nz[:, ::-1], axis=1), 0).tolist()
        acc, reach = self.accepted.tolist(), self.reaching.tolist()
        return [SpecMetrics(d, t, a, acc[r][:n], reach[r][:n])
                for r, ((d, t, a), n) in enumerate(zip(self.totals.tolist(), depth))]


def trimmed(accepted: np.ndarray, reaching: np.ndarray) -> tuple[list[int], list[int]]:
    """Per-position counts as SpecMetrics keeps them: up to the deepest position any draft reached."""
    n = max((int(np.flatnonzero(a)[-1]) + 1 for a in (accepted, reaching) if a.any()), default=0)
    return accepted[:n].tolist(), reaching[:n].tolist()
