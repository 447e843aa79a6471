"""The EAGLE-3 drafter: the head of eagle3_head.py run over its own one-layer KV cache.

The head's sequence is pairs (target feature at position t, token at t+1), at position t. After
the target's prefill it absorbs the prompt's pairs; after each verify, one pair per accepted node
(its target taps with the next emitted token). Drafting then feeds the head its own output as the
feature of the next position (reference/eagle3.md, "Feedback").
"""
from __future__ import annotations

import torch

from ...config import SpecConfig
from ...kvcache import KVCache
from ...models.attention import AttnMeta
from ...models.llama import CausalLM
from ...sampling import SamplingParams
from .eagle3_head import Eagle3Head
from .expand import NeuralDrafter


class Eagle3Drafter(NeuralDrafter):
    def __init__(self, head: Eagle3Head, target: CausalLM, spec: SpecConfig, sampling: SamplingParams,
                 batch: int, max_len: int, embed: torch.Tensor | None = None, generator=None):
        super().__init__(spec, sampling, target.config.vocab_size, generator)
        p = next(head.parameters())
        self.head, self.taps = head, head.cfg.aux_layers
        self.embed_weight = embed.to(p) if embed is not None else target.model.embed_tokens.weight
        c = head.cfg.layer
        self.cache = KVCache(1, batch, c.num_kv_heads, max_len, c.head_dim, p.dtype, p.device)
        self.d2t_ids = head.draft_to_target()
        self.full_vocab = head.cfg.draft_vocab_size == target.config.vocab_size
        self.pending = None  # (feats (B, T, H), tokens (B, T), counts list) not yet absorbed

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, self.embed_weight)

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids if self.full_vocab else self.d2t_ids[ids]

    def q_to_target(self, q: torch.Tensor) -> torch.Tensor:
        if self.full_vocab:
            return q
        out = q.new_zeros(*q.shape[:-1], self.vocab_size)
        return out.index_copy_(-1, self.d2t_ids, q)

    def start(self, prompts: list[list[int]], taps: torch.Tensor, first: torch.Tensor) -> None:
        b, t = taps.shape[:2]
        dev = first.device
        ids = torch.zeros(b, t, dtype=torch.long, device=dev)
        for i, p in enumerate(prompts):  # token at t+1 for each position t; the first sample last
            ids[i, : len(p) - 1] = torch.tensor(p[1:], device=dev)
        lens = torch.tensor([len(p) for p in prompts], device=dev)
        ids[torch.arange(b, device=dev), lens - 1] = first
        self.pending = (self.head.fc(taps), ids, [len(p) for p in prompts])

    def commit(self, prop, res, taps, emitted) -> None:
        idx = res.path[..., None].expand(*res.path.shape, taps.shape[-1])
        self.pending = (self.head.fc(taps.gather(1, idx)), res.tokens, [len(e) for e in emitted])

    def catch_up(self):
        feats, ids, counts = self.pending
        positions = self.cache.lens[:, None] + torch.arange(ids.shape[1], device=ids.device)  # (B, T)
        meta = AttnMeta.build(self.cache.lens, positions, self.cache.kv_len(ids.shape[1]))
        h = self.head(self.embed(ids), feats, positions, self.cache, meta)  # (B, T, H)
        self.cache.advance(counts)
        last = h[torch.arange(h.shape[0], device=h.device), torch.tensor(counts, device=h.device) - 1]  # (B, H)
        return self.head.logits(last), last

    def draft_step(self, ids, state, depth, mask, pending):
        b, k = ids.shape
        positions = (self.cache.lens + depth - 1)[:, None].expand(b, k)
        meta = AttnMeta.build(self.cache.lens, positions, self.cache.kv_len(pending + k), tree_mask=mask,
                              pending=pending)
        h = self.head(self.embed(self.to_target(ids)), state, positions, self.cache, meta)  # (B, K, H)
        return self.head.logits(h), h
