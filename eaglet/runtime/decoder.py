"""What plain and speculative decoding share: the target's KV cache over `batch` slots, the graph
runner, per-row token limits, and admitting prompts into free rows while other rows keep going
(the server's continuous batching; Generator admits a whole batch at once).

A decoder's `step(limit)` emits at most limit[b] tokens for row b; 0 freezes the row (finished or
free) so its cache does not move. Subclasses implement `_admit_run` (prefill a run of adjacent
rows) and `step`.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from ..kvcache import KVCache
from ..models.llama import CausalLM
from ..sampling import SamplingParams
from .graphs import GraphRunner, span
from .timer import PhaseTimer


def adjacent_runs(rows: list[int]) -> list[tuple[int, int, list[int]]]:
    """Group row indices into runs of adjacent rows: (lo, hi, positions of those rows in `rows`)."""
    order = sorted(range(len(rows)), key=rows.__getitem__)
    runs: list[tuple[int, int, list[int]]] = []
    for i in order:
        if runs and rows[i] == runs[-1][1]:
            lo, hi, idx = runs[-1]
            runs[-1] = (lo, hi + 1, idx + [i])
        else:
            runs.append((rows[i], rows[i] + 1, [i]))
    return runs


class SlotDecoder:
    def __init__(self, model: CausalLM, batch: int, max_len: int, sampling: SamplingParams,
                 generator: torch.Generator | None, graphs: bool = True, timer: PhaseTimer | None = None):
        p = next(model.parameters())
        self.model, self.sampling, self.gen, self.timer = model, sampling, generator, timer
        self.device = p.device
        self.cache = KVCache.for_model(model.config, batch, max_len, p.dtype, p.device)
        self.graphs = GraphRunner(p.device, graphs, generator)
        self.limit = torch.zeros(batch, dtype=torch.long, device=p.device)  # tokens row b may still emit
        self._limit_host = torch.zeros(batch, dtype=torch.long, pin_memory=p.device.type == "cuda")

    @property
    def batch(self) -> int:
        return self.cache.batch

    def set_limit(self, limit: list[int]) -> None:
        """Copy this step's per-row limits to the device without a sync (pinned buffer; the previous
        step's copy finished before that step's outputs reached the host)."""
        self._limit_host.copy_(torch.tensor(limit, dtype=torch.long))
        self.limit.copy_(self._limit_host, non_blocking=True)

    def span_of(self, cache: KVCache, room: int) -> int:
        """Fix the cache's attention span for this step (part of every graph key)."""
        cache.kv_limit = span(int(cache.host_lens.max()) + room, cache.max_len)
        return cache.kv_limit

    def phase(self, name: str):
        return self.timer.phase(name) if self.timer else nullcontext()

    def admit(self, rows: list[int], prompts: list[list[int]]) -> list[list[int]]:
        """Prefill prompts into the given (free) rows; returns each one's first token."""
        first: list[list[int]] = [[] for _ in rows]
        for lo, hi, idx in adjacent_runs(rows):
            for i, tok in zip(idx, self._admit_run(lo, hi, [prompts[i] for i in idx])):
                first[i] = [tok]
        return first

    def _admit_run(self, lo: int, hi: int, prompts: list[list[int]]) -> list[int]:
        raise NotImplementedError

    def release(self, rows: list[int]) -> None:
        """Free rows at once: their cache length drops to 0."""
        self.cache.release(rows)

    def reset(self) -> None:
        self.release(list(range(self.batch)))
