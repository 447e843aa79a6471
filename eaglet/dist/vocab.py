"""The vocabulary-parallel input embedding and output layer (as vLLM and SGLang split them).

Rank r of N holds rows [r R, (r+1) R) of the embedding table and of lm_head, R = ceil(V / N); the
last rank's rows past V are zeros (ModelConfig.vocab_slice says which rows a rank holds). A lookup
takes the rows a rank holds and zeros for the rest, and one all-reduce sums them: exactly the
whole table's rows, since one rank contributes each. The output layer's R logits of each rank are
gathered into all V, so every rank samples from the same logits. With V = 163,840 and H = 7,168
(Kimi-K2) a rank then reads 2 x 294 MB of these tables instead of 2 x 2.35 GB."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..models.llama import embed

# torch 2.13 renamed all_gather_into_tensor (same arguments); pyproject admits torch from 2.5
_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def rows(vocab: int, rank: int, world: int) -> tuple[int, int]:
    """(first row, rows held) of `rank` among `world`: every rank holds ceil(vocab / world) rows."""
    n = -(-vocab // world)
    return rank * n, n


def slice_rows(t: torch.Tensor, first: int, n: int) -> torch.Tensor:
    """Rows [first, first + n) of a (V, H) table, zero-padded past its end."""
    part = t[first:first + n]
    if len(part) == n:
        return part
    return torch.cat([part, part.new_zeros(n - len(part), *t.shape[1:])])


def lookup(weight: torch.Tensor, ids: torch.Tensor, first: int) -> torch.Tensor:
    """The whole table's rows for `ids` (...) -> (..., H), from this rank's rows `weight` (R, H)
    starting at `first`: one all-reduce over the default process group."""
    local = ids - first
    held = (local >= 0) & (local < weight.shape[0])
    h = embed(weight, local.clamp(0, weight.shape[0] - 1))
    h = h.masked_fill(~held[..., None], 0)
    dist.all_reduce(h)
    return h


def gather(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Each rank's (..., R) logits -> the whole (..., vocab) on every rank: one all-gather."""
    world = dist.get_world_size()
    out = logits.new_empty(world * logits.shape[0], *logits.shape[1:])  # the ranks' along dim 0 (gloo's form)
    _gather(out, logits.contiguous())
    whole = out.view(world, *logits.shape).movedim(0, -2).reshape(*logits.shape[:-1], world * logits.shape[-1])
    return whole if whole.shape[-1] == vocab else whole[..., :vocab].contiguous()


def whole_table(weight: torch.Tensor, vocab: int) -> torch.Tensor:
    """The whole (vocab, H) table from every rank's rows (R, H): one all-gather, a new tensor."""
    world = dist.get_world_size()
    out = weight.new_empty(world * weight.shape[0], *weight.shape[1:])
    _gather(out, weight.detach().contiguous())
    return out[:vocab]
