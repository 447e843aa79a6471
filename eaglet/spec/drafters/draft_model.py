"""A smaller model with the target's tokenizer as the drafter. Its cache holds the committed
sequence up to the last root; each round it first absorbs the newly committed tokens (accepted
drafts and the bonus) in one forward, then drafts from there."""
from __future__ import annotations

import torch

from ...config import SpecConfig
from ...errors import ModelLoadError
from ...kvcache import KVCache
from ...models.llama import CausalLM
from .expand import NeuralDrafter


class DraftModelDrafter(NeuralDrafter):
    taps = ()
    fed_past_prompt = 1  # the first sampled token

    def __init__(self, draft: CausalLM, target: CausalLM, spec: SpecConfig, batch: int, max_len: int):
        if draft.config.vocab_size != target.config.vocab_size:
            raise ModelLoadError(f"draft model vocabulary {draft.config.vocab_size} does not match the "
                                 f"target's {target.config.vocab_size}")
        p = next(draft.parameters())
        cache = KVCache.for_model(draft.config, batch, max_len, p.dtype, p.device)
        super().__init__(spec, target.config.vocab_size, cache, draft.config.hidden_size)
        self.model, self.window, self.kernels = draft, draft.config.sliding_window, draft.kernels

    def prompt_inputs(self, batch, taps, first):
        ids = torch.cat([batch.ids, batch.ids[:, :1]], 1).scatter(1, batch.lens[:, None], first[:, None])  # prompt, first
        return ids, None

    def absorb(self, cache, ids, feats, positions, meta):
        hidden, _ = self.model(ids, positions, cache, meta)
        return hidden

    def root_logits(self, h):
        return self.model.logits(h)

    def draft_step(self, ids, state, depth, mask, pending):
        positions, meta = self.level_meta(*ids.shape, depth, mask, pending)
        return self.model.logits(self.absorb(self.cache, ids, None, positions, meta)), None
