"""A smaller model with the target's tokenizer as the drafter. Its cache holds the committed
sequence up to the last root; each round it first absorbs the newly committed tokens (accepted
drafts and the bonus) in one forward, then drafts from there."""
from __future__ import annotations

import torch

from ...config import SpecConfig
from ...errors import ModelLoadError
from ...kvcache import KVCache
from ...models.attention import AttnMeta
from ...models.llama import CausalLM
from ...sampling import SamplingParams
from .expand import NeuralDrafter


class DraftModelDrafter(NeuralDrafter):
    taps = ()

    def __init__(self, draft: CausalLM, target: CausalLM, spec: SpecConfig, sampling: SamplingParams,
                 batch: int, max_len: int, generator=None):
        if draft.config.vocab_size != target.config.vocab_size:
            raise ModelLoadError(f"draft model vocabulary {draft.config.vocab_size} does not match the "
                                 f"target's {target.config.vocab_size}")
        super().__init__(spec, sampling, target.config.vocab_size, generator)
        p = next(draft.parameters())
        self.model = draft
        self.cache = KVCache.for_model(draft.config, batch, max_len, p.dtype, p.device)
        self.pending: list[list[int]] = []  # committed tokens not yet in the draft cache

    def start(self, prompts, taps, first) -> None:
        self.pending = [p + [t] for p, t in zip(prompts, first.tolist())]  # sync: once per request

    def commit(self, prop, res, taps, emitted) -> None:
        self.pending = [list(e) for e in emitted]

    def forward(self, ids, positions, tree_mask=None, pending=0):
        meta = AttnMeta.build(self.cache.lens, positions, self.cache.kv_len(pending + ids.shape[1]),
                              tree_mask=tree_mask, pending=pending, sliding_window=self.model.config.sliding_window)
        hidden, _ = self.model(ids, positions, self.cache, meta)
        return hidden

    def catch_up(self):
        dev = self.cache.lens.device
        t = max(map(len, self.pending))
        ids = torch.tensor([p + [0] * (t - len(p)) for p in self.pending], device=dev)  # (B, T)
        positions = self.cache.lens[:, None] + torch.arange(t, device=dev)
        hidden = self.forward(ids, positions)
        counts = [len(p) for p in self.pending]
        self.cache.advance(counts)
        last = hidden[torch.arange(len(counts), device=dev), torch.tensor(counts, device=dev) - 1]
        return self.model.logits(last), None

    def draft_step(self, ids, state, depth, mask, pending):
        b, k = ids.shape
        positions = (self.cache.lens + depth - 1)[:, None].expand(b, k)
        return self.model.logits(self.forward(ids, positions, mask, pending)), None
