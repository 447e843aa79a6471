"""The speculation cost model: speedup S = τ · T_decode / (T_draft + T_verify + T_other).

τ (tokens per verify step, bonus counted) comes from measured acceptance: for a chain of γ
drafts, τ(γ) = 1 + Σ_{i≤γ} a_i with a_i the measured probability that draft position i is accepted
(exact for any γ up to the measured depth, since a greedy drafter's i-th draft does not depend on
γ); with one per-token rate α, τ = (1 - α^(γ+1)) / (1 - α) (Leviathan et al. 2023). T_verify(n) is
read off the measured verify-cost curve (linear between measured token counts).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass


def chain_tau(alpha: float, steps: int) -> float:
    """Expected accept length of a chain of `steps` drafts with independent acceptance α."""
    if alpha >= 1.0:
        return steps + 1.0
    return (1 - alpha ** (steps + 1)) / (1 - alpha)


def tau_from_positions(accept_per_pos: list[float], steps: int) -> float:
    """τ of a chain of `steps` from unconditional per-position acceptance rates a_1, a_2, ..."""
    if steps > len(accept_per_pos):
        raise ValueError(f"acceptance measured to depth {len(accept_per_pos)}, not {steps}")
    return 1.0 + sum(accept_per_pos[:steps])


@dataclass(frozen=True)
class Costs:
    """Measured times in milliseconds (one sequence, or one batch of a given size)."""
    decode_ms: float  # one plain decode step
    draft_ms: float  # one draft step (the drafter's forward for one tree level)
    verify_ms: dict[int, float]  # tokens verified in one target forward -> time
    other_ms: float = 0.0  # accept + commit + bookkeeping per speculation step

    def verify(self, tokens: int) -> float:
        xs = sorted(self.verify_ms)
        if tokens in self.verify_ms:
            return self.verify_ms[tokens]
        if tokens < xs[0] or tokens > xs[-1]:
            if len(xs) == 1:
                return self.verify_ms[xs[0]]
            lo, hi = (xs[0], xs[1]) if tokens < xs[0] else (xs[-2], xs[-1])
        else:
            i = bisect.bisect_left(xs, tokens)
            lo, hi = xs[i - 1], xs[i]
        f = (tokens - lo) / (hi - lo)
        return self.verify_ms[lo] + f * (self.verify_ms[hi] - self.verify_ms[lo])

    def step_ms(self, steps: int, tokens: int) -> float:
        """One speculation step: `steps` draft levels, one verify of `tokens`, bookkeeping."""
        return steps * self.draft_ms + self.verify(tokens) + self.other_ms

    def speedup(self, tau: float, steps: int, tokens: int) -> float:
        return tau * self.decode_ms / self.step_ms(steps, tokens)

    def break_even_tau(self, steps: int, tokens: int) -> float:
        """The accept length at which speculation exactly matches plain decoding."""
        return self.step_ms(steps, tokens) / self.decode_ms

    def break_even_verify_ms(self, tau: float, steps: int) -> float:
        """The verify time at which speculation with accept length τ exactly breaks even."""
        return tau * self.decode_ms - steps * self.draft_ms - self.other_ms
