"""Sampling without a host sync: each row's own settings and random stream (RowSampling).

`target_probs` is the distribution of one setting (temperature, top-k, top-p), the reference the
tests hold the engine to. A decoder's rows each have their own settings: `RowSampling` holds every
row's temperature, top-k, top-p and random stream as device tensors (B,), read inside the step
graphs, so greedy and sampled requests with different settings and seeds share one batch. A row's
draw at a position is the Gumbel-max of its scaled logits with noise hashed from its stream key and
the position (counter-based), so plain and speculative decoding draw the same tokens, and what a
row draws never depends on the other rows of the batch.
"""
from __future__ import annotations

import random
import secrets
from dataclasses import dataclass

import numpy as np
import torch

from . import cut_draw
from .errors import InvalidInput
from .kernels import fusable
from .spec import topk

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
        drop = nucleus_cut(sorted_logits, sorted_logits.softmax(-1), p.top_p)
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return logits.softmax(-1)


def nucleus_cut(sx: torch.Tensor, sp: torch.Tensor, top_p) -> torch.Tensor:
    """Which entries top-p cuts, over logits sorted largest first (sx) and their probabilities (sp):
    those whose probability strictly above them (larger logits) already reaches top_p. Equal logits
    are kept or cut together, whatever order the sort gave them (as cut_draw's kernel cuts)."""
    before = sp.cumsum(-1) - sp
    first = torch.ones_like(sx, dtype=torch.bool)
    first[..., 1:] = sx[..., 1:] != sx[..., :-1]
    before = torch.where(first, before, -1.0).cummax(-1).values  # the mass before each run of equal logits
    return before >= top_p


# ---- counter-based random numbers ----------------------------------------------------------------

_MASK = 0xFFFFFFFF
_MUL = 0x45D9F3B  # a 32-bit integer hash's multiplier; below 2**27, so products stay inside int64
_VOCAB_SALT = 0x632BE5AB


def argmax(logits: torch.Tensor, kernels=None) -> torch.Tensor:
    """(..., V) -> (...): each row's largest entry, the lowest index on ties (torch.argmax's). Rows of
    topk.SPLIT_WIDTH or more go through the split top-k kernels with k = 1 where the model's kernels
    take top-k (`--disable-kernels topk` turns it off): torch's reduction reads a 49,152-wide row in
    one block, 12-13 µs graphed at 1 to 64 rows, where the split kernels took 2.8-5.4 µs on the H200
    with the same picks (the argmax probe, notebook, nineteenth session)."""
    if kernels is not None and kernels.topk and logits.shape[-1] >= topk.SPLIT_WIDTH and topk.usable(logits, 1):
        return topk.topk(logits, 1, kernel=True)[1][..., 0]
    return logits.argmax(-1)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of x (int64 holding values in [0, 2**32))."""
    x = ((x >> 16) ^ x) * _MUL & _MASK
    x = ((x >> 16) ^ x) * _MUL & _MASK
    return (x >> 16) ^ x


@fusable
def position_seeds(key: torch.Tensor, base: torch.Tensor, offset) -> torch.Tensor:
    """(B, ...) the noise key of each row at position base + offset: key (B,) the rows' streams
    (62-bit), base (B,) their positions, offset an int or (B, ...)."""
    h = mix32(mix32(key & _MASK) ^ ((key >> 32) & _MASK))  # (B,)
    pos = base.view(-1, *([1] * (offset.dim() - 1))) + offset if torch.is_tensor(offset) else base + offset
    return mix32(h.view(pos.shape[:1] + (1,) * (pos.dim() - 1)) ^ mix32(pos & _MASK))


@fusable
def gumbel_argmax(x: torch.Tensor, seed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """argmax(x + Gumbel noise) over the last dimension: x (..., V) scaled logits, seed (...) the
    noise's key per row and position, ids (V,) each entry's hashed token id. The noise of token v is
    -log(-log(u)), u a hash of (seed, v) in (0, 1): a sample of softmax(x) (the Gumbel-max trick),
    in one pass over the logits (one kernel compiled)."""
    return gumbel_noised(x, seed, ids).argmax(-1)


@fusable
def gumbel_noised(x: torch.Tensor, seed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """x plus the Gumbel noise gumbel_argmax adds: token v's is -log(-log(u)), u a hash of (seed, v).
    u takes 23 bits: (j + 0.5) / 2**23 is exact in float32 and inside (0, 1), where 24 bits rounded the
    largest to 1.0, an infinite noise that won the draw whatever the logits, even for a token the cut
    had removed (-inf + inf: NaN, which argmax takes): 0.3% of draws over a 49,152-token vocabulary."""
    u = mix32(seed[..., None] ^ ids)
    u = ((u >> 9).float() + 0.5) / float(1 << 23)
    return x - torch.log(-torch.log(u))


@fusable
def tempered_noise(x: torch.Tensor, t: torch.Tensor, seed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """x / t plus gumbel_argmax's noise where t > 0, x where t == 0 (float32; t broadcast to x)."""
    x = x.float()
    return torch.where(t == 0, x, gumbel_noised(x / torch.where(t == 0, 1.0, t), seed, ids))


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

    def general(self) -> None:
        """The path right for every row whatever its settings (the filtered one: top-k 0 and top-p
        1 cut nothing, greedy rows take their argmax)."""
        self.sampled = self.filtered = True


class RowSampling:
    """Each row's sampling settings and random stream on the device, (B,) tensors: temperature
    (0: greedy), top_k (0: off), top_p and the stream key; `base` is each row's position (the
    target cache's committed length, whose storage it shares). On the host, `sampled` and
    `filtered` say per row whether it samples and whether top-k or top-p cut its distribution
    (what `choose_mode` reads each step).

    A sampled row's token at position t is argmax(logits / T + g), g Gumbel noise hashed from the
    row's key and t alone (`pick`): a sample of its distribution, fresh at every position, and the
    same whoever computes it. A plain step and a verify that reach position t draw the same token
    there, so a speculating row emits exactly what plain sampling emits with the same key: the
    verify accepts a drafted child when it equals the target's draw at its parent (greedy
    acceptance against the draws), which is lossless, and the drafter, drawing its chain with the
    same noise, proposes what the target will likely draw. Nothing a row draws depends on the other
    rows of the batch or on how many there are: a seeded request gives the same text wherever it
    runs, speculating or not."""

    def __init__(self, batch: int, device, base: torch.Tensor | None = None):
        z = lambda dtype: torch.zeros(batch, dtype=dtype, device=device)  # noqa: E731
        self.temperature, self.top_p = z(torch.float32), z(torch.float32) + 1
        self.top_k, self.key = z(torch.long), z(torch.long)
        self.base = z(torch.long) if base is None else base
        self.sampled, self.filtered = np.zeros(batch, dtype=bool), np.zeros(batch, dtype=bool)
        self.mode = Mode()
        self._ids: dict[tuple, torch.Tensor] = {}  # hashed token ids per vocabulary (shared by views)

    @property
    def batch(self) -> int:
        return self.key.shape[0]

    def _like(self, pick) -> "RowSampling":
        v = object.__new__(RowSampling)
        for name in ("temperature", "top_p", "top_k", "key", "base"):
            setattr(v, name, pick(getattr(self, name)))
        v.sampled, v.filtered, v.mode, v._ids = self.sampled, self.filtered, self.mode, self._ids
        return v

    def rows(self, k: int) -> "RowSampling":
        """Rows 0..k-1 (views: writes land in this storage)."""
        return self._like(lambda t: t[:k])

    def select(self, rows: torch.Tensor) -> "RowSampling":
        """The settings of `rows` (b,), gathered (a prefill's admitted rows)."""
        return self._like(lambda t: t.index_select(0, rows))

    def set(self, rows: list[int], params: list[SamplingParams], keys: list[int]) -> None:
        """Give these rows their settings and streams (on the device without a sync)."""
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

    def choose_mode(self, rows) -> str:
        """Set the mode for a step over `rows` (host indices) from their settings; returns its key."""
        self.mode.sampled = bool(self.sampled[rows].any())
        self.mode.filtered = bool(self.filtered[rows].any())
        return self.mode.key

    # ---- draws ----
    def scaled(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, ..., V) logits -> float32 logits / temperature (greedy rows: as they are), with what
        top-k and top-p cut at -inf: softmax of it is target_probs of each row's settings."""
        x = logits.float()
        shape = (x.shape[0],) + (1,) * (x.dim() - 1)
        t = self.temperature.view(shape)
        x = x / torch.where(t == 0, torch.ones_like(t), t)
        if self.mode.filtered:
            v = x.shape[-1]
            sx, order = x.sort(-1, descending=True)
            k = torch.where(self.top_k > 0, self.top_k.clamp(max=v), v).view(shape)
            kth = sx.gather(-1, (k - 1).expand(*x.shape[:-1], 1))
            sx = sx.masked_fill(sx < kth, float("-inf"))
            top_p = self.top_p.view(shape)
            sx = sx.masked_fill(nucleus_cut(sx, sx.softmax(-1), top_p) & (top_p < 1), float("-inf"))
            x = torch.empty_like(x).scatter_(-1, order, sx)
        return x

    def seeds(self, offset, kernels=None) -> torch.Tensor:
        """(B, ...) the noise key of each row at position base + offset (offset an int or (B, ...)),
        in one compiled kernel where `kernels` compile (eager, it is ~48 tiny ones: a step's graph
        replays each)."""
        fn = position_seeds if kernels is None else kernels.fuse(position_seeds)
        return fn(self.key, self.base, offset)

    def vocab_ids(self, v: int, vocab: torch.Tensor | None = None) -> torch.Tensor:
        """(v,) the hashed token id of each logit: index i is token i, or vocab[i] (a drafter's own
        vocabulary mapped to the target's, so its noise is the target's)."""
        key = (v, None if vocab is None else vocab.data_ptr())
        if key not in self._ids:
            ids = torch.arange(v, device=self.key.device) if vocab is None else vocab.long()
            self._ids[key] = mix32(ids + _VOCAB_SALT)
        return self._ids[key]

    def noised(self, logits: torch.Tensor, offset: int, kernels=None, vocab: torch.Tensor | None = None) -> torch.Tensor:
        """(B, ..., V) logits of tokens at position base + offset -> float32: a sampled row's logits
        over its temperature plus the noise of its draw there, a greedy row's as they are. Without
        the top-k / top-p cut, so its argmax is `pick`'s draw unless that falls outside the cut: a
        draft tree's guesses at the draw, for one fused kernel instead of a sort of the vocabulary."""
        if not self.mode.sampled:
            return logits.float()
        seed = self.seeds(offset, kernels)
        fn = tempered_noise if kernels is None else kernels.fuse(tempered_noise)
        return fn(logits, self.temperature.view((-1,) + (1,) * (logits.dim() - 1)),
                  seed.view(seed.shape + (1,) * (logits.dim() - 2)), self.vocab_ids(logits.shape[-1], vocab))

    def pick(self, logits: torch.Tensor, offset, kernels=None, vocab: torch.Tensor | None = None) -> torch.Tensor:
        """(B, ..., V) logits of the tokens at positions base + offset (offset an int or (B, ...))
        -> (B, ...) each row's token: greedy rows the argmax, sampled rows their draw there."""
        best = argmax(logits, kernels)
        if not self.mode.sampled:
            return best
        ids = self.vocab_ids(logits.shape[-1], vocab)
        if self.mode.filtered and kernels is not None and kernels.draw and cut_draw.usable(logits):
            drawn = cut_draw.cut_draw(logits, self.temperature, self.top_k, self.top_p, self.seeds(offset, kernels), ids)
        else:  # the cut by a sort of each row's vocabulary, then one fused pass
            fn = gumbel_argmax if kernels is None else kernels.fuse(gumbel_argmax)
            drawn = fn(self.scaled(logits), self.seeds(offset, kernels), ids)
        greedy = (self.temperature == 0).view((-1,) + (1,) * (best.dim() - 1))
        return torch.where(greedy, best, drawn)
