"""The plain decoding step: one target forward per row and step, each row fed its last token and
the next one sampled (one graph per row bucket and attention span). Every decoder has one
(`Decoder.plain`); a speculating batch turns plain by using it on the same rows and cache.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from ..kernels import fusable
from ..models.attention import AttnMeta
from ..models.llama import CausalLM
from ..models.prefill import PromptBatch, prefill

if TYPE_CHECKING:
    from .decoder import Slots
    from .graphs import GraphRunner
    from .observer import StepObserver


def eos_reach(tokens: torch.Tensor, eos: torch.Tensor, stops: torch.Tensor) -> torch.Tensor:
    """(B, M) tokens a step may emit -> (B,) how many it may emit up to and with the first EOS of a
    row that stops at EOS (M + 1 where there is none). A step cuts a row's tokens there and, when
    it emits exactly that many, sets the row's limit to 0: the device stops it (graph-safe)."""
    m = tokens.shape[1]
    hit = (tokens[..., None] == eos).any(-1) & stops[:, None]  # (B, M)
    return torch.where(hit.any(1), hit.int().argmax(1) + 1, m + 1)


@fusable
def advance(tok: torch.Tensor, last: torch.Tensor, lens: torch.Tensor, limit: torch.Tensor, eos: torch.Tensor,
            stops: torch.Tensor) -> torch.Tensor:
    """A plain step's bookkeeping after its draw, one compiled region on the GPU (about twenty small
    kernels otherwise): rows with tokens left (limit > 0) take `tok` as their last token, and their
    cache length and limit move by one; a row that stops at EOS and drew it gets limit 0 (the device
    stops it). Updates last, lens and limit in place; returns (B, 2): each row's token and whether it
    emitted one."""
    on = limit > 0
    active = on.long()
    last.copy_(torch.where(on, tok, last))
    lens.add_(active)
    limit.sub_(active)
    limit.masked_fill_(on & (eos_reach(tok[:, None], eos, stops) == 1), 0)
    return torch.stack([last, active], 1)


def first_tokens(logits: torch.Tensor, slots: "Slots", batch: PromptBatch, kernels=None) -> torch.Tensor:
    """The first token of each admitted prompt (b,) from its last position's logits (b, V), drawn
    with its row's settings at the position after the prompt (the cache's length once prefilled)
    by the model's kernels (a prefill's draw is on the general path, cut_draw's where it is on,
    not a sort of the vocabulary); it becomes the row's last token (graph-safe)."""
    first = slots.sampling.select(batch.rows).pick(logits, 0, kernels)
    slots.last.index_copy_(0, batch.rows, first)
    return first


class PlainStep:
    name = "plain"
    tokens_per_step = 1
    pipelines = True

    def __init__(self, model: CausalLM, slots: "Slots"):
        self.model, self.slots = model, slots

    def rows(self, k: int) -> "PlainStep":
        return PlainStep(self.model, self.slots.rows(k))

    def room(self):
        return [(self.slots.cache, 1)]

    def prefill(self, batch: PromptBatch) -> torch.Tensor:
        h, _ = prefill(self.model, self.slots.cache, batch)  # (b, H)
        return first_tokens(self.model.logits(h), self.slots, batch, self.model.kernels)

    def admitted(self, rows: list[int], prompts: list[list[int]], first: list[int]) -> None:
        pass

    def launch(self, graphs: "GraphRunner", key: tuple, observer: "StepObserver") -> torch.Tensor:
        with observer.phase("decode"):
            return graphs.run(("decode", *key), self.decode)

    def decode(self) -> torch.Tensor:
        """Feed each row's last token, sample the next; frozen rows (limit 0) do not move. Returns
        (B, 2): each row's token and whether it emitted one."""
        c, model, last, limit = self.slots.cache, self.model, self.slots.last, self.slots.limit
        positions = c.lens[:, None]  # (B, 1)
        meta = AttnMeta.build(c.lens, positions, c.kv_len(1), sliding_window=model.config.sliding_window,
                              kernels=model.kernels)
        hidden, _ = model(last[:, None], positions, c, meta)
        tok = self.slots.sampling.pick(model.logits(hidden[:, -1]), 1, model.kernels)  # (B,) after `last`
        return model.kernels.fuse(advance)(tok, last, c.lens, limit, self.slots.eos, self.slots.stops)

    def collect(self, rows: list[list[int]], same: list[bool], live: np.ndarray,
                observer: "StepObserver") -> list[list[int]]:
        emitted = [[tok] if active and ok else [] for (tok, active), ok in zip(rows, same)]
        self.slots.cache.commit_host([len(e) for e in emitted])
        return emitted

    def release(self, rows: list[int]) -> None:
        pass
