"""Speculation metrics, named like vLLM's: drafts (verify steps), draft tokens, accepted tokens,
accepted tokens per draft position; accept length τ counts the bonus token (reference/eagle3.md)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecMetrics:
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0  # drafted tokens accepted (bonus not counted)
    accepted_per_pos: list[int] = field(default_factory=list)  # position i (1-based depth) accepted
    drafts_reaching_pos: list[int] = field(default_factory=list)  # drafts that proposed depth i

    def record(self, accepted: int, draft_tokens: int, max_depth: int) -> None:
        self.drafts += 1
        self.draft_tokens += draft_tokens
        self.accepted_tokens += accepted
        grow = max(max_depth, accepted) - len(self.accepted_per_pos)
        if grow > 0:
            self.accepted_per_pos += [0] * grow
            self.drafts_reaching_pos += [0] * grow
        for i in range(accepted):
            self.accepted_per_pos[i] += 1
        for i in range(max_depth):
            self.drafts_reaching_pos[i] += 1

    def merge(self, other: "SpecMetrics") -> None:
        self.drafts += other.drafts
        self.draft_tokens += other.draft_tokens
        self.accepted_tokens += other.accepted_tokens
        n = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        pad = lambda xs: xs + [0] * (n - len(xs))  # noqa: E731
        self.accepted_per_pos = [a + b for a, b in zip(pad(self.accepted_per_pos), pad(other.accepted_per_pos))]
        self.drafts_reaching_pos = [a + b for a, b in zip(pad(self.drafts_reaching_pos),
                                                          pad(other.drafts_reaching_pos))]

    def copy(self) -> "SpecMetrics":
        return SpecMetrics(self.drafts, self.draft_tokens, self.accepted_tokens, list(self.accepted_per_pos),
                           list(self.drafts_reaching_pos))

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
