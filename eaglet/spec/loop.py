"""The speculation loop, read like the paper: draft -> verify -> accept -> commit.

SpecDecoder has the same interface as generate.PlainDecoder (prefill, step), so the Generator's
streaming and stopping logic is shared. One host sync per step: the emitted tokens.
"""
from __future__ import annotations

import torch

from ..config import SpecConfig
from ..kvcache import KVCache
from ..models.attention import AttnMeta
from ..models.llama import CausalLM
from ..models.prefill import prefill
from ..sampling import SamplingParams, sample, target_probs
from .drafters.base import Drafter
from .metrics import SpecMetrics
from .verify import greedy_verify, sample_verify


class SpecDecoder:
    def __init__(self, model: CausalLM, drafter: Drafter, spec: SpecConfig, batch: int, max_len: int,
                 sampling: SamplingParams, generator: torch.Generator | None = None, trace: list | None = None):
        p = next(model.parameters())
        self.model, self.drafter, self.spec, self.sampling = model, drafter, spec, sampling
        self.cache = KVCache.for_model(model.config, batch, max_len + spec.draft_tokens, p.dtype, p.device)
        self.gen = generator
        self.metrics = [SpecMetrics() for _ in range(batch)]
        self.roots: torch.Tensor | None = None
        self.trace = trace  # the profiler's: per step (scores, depths, accepted path, count, limit)

    def prefill(self, prompts: list[list[int]]) -> list[list[int]]:
        h, taps = prefill(self.model, self.cache, prompts, capture=self.drafter.taps)  # (B, H)
        self.roots = sample(self.model.logits(h).float(), self.sampling, self.gen)  # (B,)
        self.drafter.start(prompts, taps, self.roots)
        return [[t] for t in self.roots.tolist()]  # sync: first tokens to the host

    def step(self, limit: list[int]) -> list[list[int]]:
        """One draft-verify-accept-commit round; row b emits at most limit[b] tokens (0: finished)."""
        # draft
        prop = self.drafter.propose(self.roots)
        # verify: every node in one target forward, tree mask, per-node positions
        positions = self.cache.lens[:, None] + prop.depth  # (B, N)
        meta = AttnMeta.build(self.cache.lens, positions, self.cache.kv_len(prop.num_nodes), tree_mask=prop.mask,
                              sliding_window=self.model.config.sliding_window)
        hidden, taps = self.model(prop.tokens, positions, self.cache, meta, capture=self.drafter.taps)
        logits = self.model.logits(hidden).float()  # (B, N, V)
        # accept
        if self.sampling.greedy:
            res = greedy_verify(prop, logits.argmax(-1), self.spec.steps)
        else:
            res = sample_verify(prop, target_probs(logits, self.sampling), self.spec.steps, self.spec.topk, self.gen)
        res = res.limit(torch.tensor(limit, device=res.count.device))  # never past a row's budget
        drafted = prop.valid.sum(1, keepdim=True) - 1  # (B, 1)
        reach = (prop.depth * prop.valid).amax(1, keepdim=True)  # (B, 1) deepest drafted position
        packed = torch.cat([res.count[:, None], drafted, reach, res.tokens], 1).tolist()  # sync: the one per step
        counts = [r[0] for r in packed]
        emitted = [r[3:3 + r[0]] for r in packed]
        # commit: only the accepted path stays in the target's and the drafter's caches
        self.cache.keep(res.path, res.count, counts)
        self.drafter.commit(prop, res, taps, emitted)
        self.roots = res.bonus
        for i, r in enumerate(packed):
            if limit[i] > 0:
                self.metrics[i].record(accepted=r[0] - 1, draft_tokens=r[1], max_depth=r[2])
        if self.trace is not None and prop.score is not None:
            self.trace.append((prop.score.cpu(), prop.depth.cpu(), res.path.cpu(), counts, list(limit)))
        return emitted
