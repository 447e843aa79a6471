"""The EAGLE-3 drafter: the head of eagle3_head.py run over its own KV cache (one layer per head layer).

The head's sequence is pairs (target feature at position t, token at t+1), at position t. When a
prompt is admitted it absorbs the prompt's pairs; after each verify, one pair per accepted node
(its target taps with the next emitted token), absorbed at the start of the next propose. Drafting
then feeds the head its own output as the feature of the next position (docs/eagle3.md,
"Feedback").
"""
from __future__ import annotations

import torch

from ...config import SpecConfig
from ...kvcache import KVCache
from ...models.llama import CausalLM, embed
from .eagle3_head import Eagle3Head
from .expand import NeuralDrafter


class Eagle3Drafter(NeuralDrafter):
    feeds_state = True
    row_tensors = NeuralDrafter.row_tensors + ("pend_feats",)

    def __init__(self, head: Eagle3Head, target: CausalLM, spec: SpecConfig, batch: int, max_len: int,
                 embed: torch.Tensor | None = None):
        p = next(head.parameters())
        c = head.cfg.layer
        cache = KVCache(c.num_layers, batch, c.num_kv_heads, max_len, c.head_dim, p.dtype, p.device)
        super().__init__(spec, target.config.vocab_size, cache, c.hidden_size)
        self.head, self.taps, self.kernels = head, head.cfg.aux_layers, head.kernels
        # the drafter's own embedding table where it brings one, else the target's (which under
        # vocabulary parallelism is a lookup over the ranks: CausalLM.embed)
        self.own_embed = embed.to(p) if embed is not None else None
        self.target_embed = target.embed
        self.d2t_ids = head.draft_to_target()
        self.full_vocab = head.cfg.draft_vocab_size == target.config.vocab_size
        # draft ids embed through their own rows (one gather a level instead of two)
        self.draft_embed = None if self.full_vocab else self.embed(self.d2t_ids)  # (Vd, H)
        self.pend_feats = torch.zeros(batch, spec.steps + 1, c.hidden_size, dtype=p.dtype, device=p.device)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.target_embed(ids) if self.own_embed is None else embed(self.own_embed, ids)

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids if self.full_vocab else self.d2t_ids[ids]

    def prompt_inputs(self, batch, taps, first):
        # the token at t+1 for each position t, the first sample at the last (the rest is padding)
        ids = torch.cat([batch.ids[:, 1:], batch.ids[:, :1]], 1).scatter(1, (batch.lens - 1)[:, None], first[:, None])
        return ids, self.head.fc(taps)

    def pending_feats(self):
        return self.pend_feats

    def commit(self, prop, res, taps) -> None:
        super().commit(prop, res, taps)
        idx = res.path[..., None].expand(*res.path.shape, taps.shape[-1])
        self.pend_feats[:, :idx.shape[1]].copy_(self.head.fc(taps.gather(1, idx)))  # (B, D+1, H)

    def absorb(self, cache, ids, feats, positions, meta):
        return self.head(self.embed(ids), feats, positions, cache, meta)  # (B, T, H)

    def root_logits(self, h):
        return self.head.logits(h)

    def draft_step(self, ids, state, depth, mask, pending):
        positions, meta = self.level_meta(*ids.shape, depth, mask, pending)
        x = self.embed(ids) if self.draft_embed is None else embed(self.draft_embed, ids)
        return self.head.step(x, state, positions, self.cache, meta)
