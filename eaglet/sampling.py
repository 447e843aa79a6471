"""Logits -> probabilities (temperature, top-k, top-p) and sampling without a host sync.

`target_probs` is also what lossless speculative acceptance compares drafts against, so plain
sampling and speculative sampling draw from exactly the same distribution.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import InvalidInput


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise InvalidInput(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise InvalidInput(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidInput(f"top_k must be a non-negative integer, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, device) -> torch.Generator | None:
        if self.seed is None:
            return None
        g = torch.Generator(device=device)
        g.manual_seed(self.seed)
        return g


def target_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """(..., V) logits -> (..., V) float32 probabilities after temperature, top-k and top-p.
    Greedy (temperature 0) gives the one-hot distribution of the argmax."""
    logits = logits.float()
    if p.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / p.temperature
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = logits.topk(p.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = logits.sort(-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p  # mass before this token already enough
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return logits.softmax(-1)


def sample_probs(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token per row by the exponential race argmax(p / Exp(1)): no host sync."""
    e = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / e).argmax(-1)


def sample(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """(..., V) logits (any float dtype) -> (...) token ids."""
    if p.greedy:
        return logits.argmax(-1)
    return sample_probs(target_probs(logits, p), generator)
