"""Logits -> probabilities (temperature, top-k, top-p) and sampling without a host sync.

`target_probs` is the distribution of one setting; `RowSampling.probs` computes it for every row
with that row's setting, and both plain sampling and lossless speculative acceptance draw from it,
so they follow exactly the same distribution.

A decoder's rows each have their own settings: `RowSampling` holds every row's temperature,
top-k, top-p and random stream as device tensors (B,), read inside the step graphs, so greedy and
sampled requests with different settings and seeds share one batch. Its random numbers are
counter-based: a draw is a hash of the row's stream key, the row's step count, what the draw is
for (`salt`) and the element's index, so what a row draws never depends on the other rows of the
batch or on how many there are. A seeded request therefore gives the same text wherever it runs.
"""
from __future__ import annotations

import random
import secrets
from dataclasses import dataclass

import numpy as np
import torch

from .errors import InvalidInput

_fresh = random.Random(secrets.randbits(128))  # unseeded streams' keys: one OS draw per process, not per request


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

    @property
    def filters(self) -> bool:
        """Whether top-k or top-p cut the distribution (a sort of the vocabulary per row)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1)

    def stream(self, index: int = 0) -> int:
        """The random stream key of the index-th sequence of a call with these settings: derived from
        the seed (the same seed and index, the same stream), else fresh."""
        if self.seed is None:
            return _fresh.getrandbits(62)
        return (self.seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9) % (1 << 62)


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


# ---- counter-based random numbers ----------------------------------------------------------------

_MASK = 0xFFFFFFFF
_MUL = 0x45D9F3B  # a 32-bit integer hash's multiplier; below 2**27, so products stay inside int64


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of x (int64 holding values in [0, 2**32))."""
    x = ((x >> 16) ^ x) * _MUL & _MASK
    x = ((x >> 16) ^ x) * _MUL & _MASK
    return (x >> 16) ^ x


# what a draw is for: draws of one row and step with different salts are independent
FIRST, DECODE, BONUS, DRAFT, ACCEPT = 1, 2, 3, 16, 64


class Mode:
    """What the rows in use ask of a step (host, shared by a RowSampling and its views): whether
    any samples (otherwise the argmax path, as fast as a greedy-only engine), and whether any cuts
    its distribution with top-k or top-p (otherwise no sort of the vocabulary). Part of the step
    graphs' keys."""

    def __init__(self):
        self.sampled = False
        self.filtered = False

    @property
    def key(self) -> str:
        return "f" if self.filtered else "s" if self.sampled else "g"


class RowSampling:
    """Each row's sampling settings and random stream on the device, (B,) tensors: temperature
    (0: greedy), top_k (0: off), top_p, the stream key and the row's draws so far (`steps`: the
    prefill and each step advance it). On the host, `sampled` and `filtered` say per row whether it
    samples and whether top-k or top-p cut its distribution (what `choose_mode` reads each step)."""

    def __init__(self, batch: int, device):
        z = lambda dtype: torch.zeros(batch, dtype=dtype, device=device)  # noqa: E731
        self.temperature, self.top_p = z(torch.float32), z(torch.float32) + 1
        self.top_k, self.key, self.steps = z(torch.long), z(torch.long), z(torch.long)
        self.sampled, self.filtered = np.zeros(batch, dtype=bool), np.zeros(batch, dtype=bool)
        self.mode = Mode()

    @property
    def batch(self) -> int:
        return self.key.shape[0]

    def _like(self, pick) -> "RowSampling":
        v = object.__new__(RowSampling)
        for name in ("temperature", "top_p", "top_k", "key", "steps"):
            setattr(v, name, pick(getattr(self, name)))
        v.sampled, v.filtered, v.mode = self.sampled, self.filtered, self.mode
        return v

    def rows(self, k: int) -> "RowSampling":
        """Rows 0..k-1 (views: writes land in this storage)."""
        return self._like(lambda t: t[:k])

    def select(self, rows: torch.Tensor) -> "RowSampling":
        """The settings of `rows` (b,), gathered (a prefill's admitted rows)."""
        return self._like(lambda t: t.index_select(0, rows))

    def set(self, rows: list[int], params: list[SamplingParams], keys: list[int]) -> None:
        """Give these rows their settings and streams (on the device without a sync; each row's
        draws start again at 0)."""
        from .transfer import to_device

        self.sampled[rows] = [not p.greedy for p in params]
        self.filtered[rows] = [p.filters for p in params]
        floats = np.array([[p.temperature, p.top_p] for p in params], dtype=np.float32).view(np.int32)
        packed = np.empty((5, len(rows)), dtype=np.int64)  # one copy to the device, not five
        packed[0], packed[1], packed[2], packed[3:] = rows, [p.top_k for p in params], keys, floats.T
        rows_d, top_k, key, floats_d = to_device(packed, torch.long, self.key.device).split([1, 1, 1, 2])
        idx = rows_d[0]
        floats_d = floats_d.to(torch.int32).view(torch.float32)
        self.temperature.index_copy_(0, idx, floats_d[0])
        self.top_p.index_copy_(0, idx, floats_d[1])
        self.top_k.index_copy_(0, idx, top_k[0])
        self.key.index_copy_(0, idx, key[0])
        self.steps.index_fill_(0, idx, 0)

    def choose_mode(self, rows) -> str:
        """Set the mode for a step over `rows` (host indices) from their settings; returns its key."""
        self.mode.sampled = bool(self.sampled[rows].any())
        self.mode.filtered = bool(self.filtered[rows].any())
        return self.mode.key

    # ---- draws ----
    def uniform(self, shape: tuple[int, ...], salt: int) -> torch.Tensor:
        """(B, *shape) float32 uniform in (0, 1): element i of row b is a hash of (b's key, b's
        draws so far, salt, i)."""
        b = self.key.shape[0]
        k = self.key
        h = mix32(mix32(k & _MASK) ^ ((k >> 32) & _MASK))
        h = mix32(h ^ mix32((self.steps * 0x9E37 + salt) & _MASK))  # (B,)
        n = 1
        for s in shape:
            n *= s
        idx = mix32(torch.arange(n, device=k.device, dtype=torch.long) + 0x632BE5AB)
        u = mix32(h[:, None] ^ idx[None])  # (B, n)
        return (((u >> 8).float() + 0.5) / float(1 << 24)).view(b, *shape)

    def exponential(self, shape: tuple[int, ...], salt: int) -> torch.Tensor:
        return -torch.log(self.uniform(shape, salt))

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, ..., V) logits -> each row's probabilities under its own settings, as target_probs
        computes them (greedy rows: the one-hot argmax)."""
        x = logits.float()
        shape = (x.shape[0],) + (1,) * (x.dim() - 1)
        t = self.temperature.view(shape)
        greedy = t == 0
        x = x / torch.where(greedy, torch.ones_like(t), t)
        if self.mode.filtered:
            v = x.shape[-1]
            sx, order = x.sort(-1, descending=True)
            k = torch.where(self.top_k > 0, self.top_k.clamp(max=v), v).view(shape)
            kth = sx.gather(-1, (k - 1).expand(*x.shape[:-1], 1))
            sx = sx.masked_fill(sx < kth, float("-inf"))
            sp = sx.softmax(-1)
            top_p = self.top_p.view(shape)
            sx = sx.masked_fill((sp.cumsum(-1) - sp >= top_p) & (top_p < 1), float("-inf"))
            x = torch.empty_like(x).scatter_(-1, order, sx)
        p = x.softmax(-1)
        onehot = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
        return torch.where(greedy, onehot, p)

    def sample(self, logits: torch.Tensor, salt: int) -> torch.Tensor:
        """(B, V) logits -> (B,) each row's token (the argmax while no row in use samples)."""
        if not self.mode.sampled:
            return logits.argmax(-1)
        return sample_probs(self.probs(logits), self, salt)


def uniform(source, shape: tuple[int, ...], device, salt: int) -> torch.Tensor:
    """Uniform (0, 1) draws of shape (B, ...) from `source`: a RowSampling (per-row streams), a
    torch.Generator or None (torch's default)."""
    if isinstance(source, RowSampling):
        return source.uniform(shape[1:], salt)
    return torch.rand(shape, device=device, generator=source)


def sample_probs(probs: torch.Tensor, source=None, salt: int = DECODE) -> torch.Tensor:
    """Draw one token per row by the exponential race argmax(p / Exp(1)): no host sync. `source` is
    a RowSampling (probs (B, ..., V), each row its own stream), a torch.Generator or None."""
    if isinstance(source, RowSampling):
        e = source.exponential(tuple(probs.shape[1:]), salt)
    else:
        e = torch.empty_like(probs).exponential_(generator=source)
    return (probs / e).argmax(-1)

