"""Every CUDA graph eaglet captures goes through one GraphRunner.

A decoder hands the runner a *step body*: a function of no arguments that reads and writes only
persistent tensors (caches, the decoder's state buffers) and returns its outputs. The runner
keys bodies by what fixes their shapes (phase, batch, attention span): the first call of a key
runs eagerly (that is the warm-up: cuBLAS plans, lazy allocations, compiled kernels), the second
captures a graph and replays it, later calls only replay. Replays return the tensors the body
returned at capture, refreshed in place, so phases chain: a graph captured after another reads
that one's outputs. All graphs of a runner share one memory pool and are captured in the order
they replay, so the pool never hands an output of one phase to the next as scratch.

Off (CPU, `--eager`, or a drafter that works on the host) the runner just calls the body: the
same code, the same kernels, the same results.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

from ..models import moe


SPAN = 128  # attention spans are multiples of this


def span(n: int, cap: int, bucket: int = SPAN) -> int:
    """The attention span used for a step that needs `n` cache slots: rounded up to `bucket` (so
    one captured graph serves many steps), never past the cache's `cap`."""
    return min(cap, -(-n // bucket) * bucket)


class GraphRunner:
    def __init__(self, device: torch.device, enabled: bool = True):
        # sampling draws counter-based random numbers from tensors (sampling.RowSampling): no
        # generator state to register with the graphs
        self.enabled = enabled and device.type == "cuda"
        self.graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, object]] = {}
        self.seen: set[Hashable] = set()
        self.pool = None

    def run(self, key: Hashable, body: Callable[[], object], graph: bool = True):
        if not (self.enabled and graph):
            return body()
        if key in self.graphs:
            g, out = self.graphs[key]
            g.replay()
            return out
        if key not in self.seen:  # first call: eager warm-up, and it does this step's work
            self.seen.add(key)
            return body()
        g = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(g, pool=self.pool):
            out = body()
        self.graphs[key] = (g, out)
        g.replay()  # capture records without running: run this step now
        return out

    @property
    def captured(self) -> int:
        return len(self.graphs)


def graphable(model: torch.nn.Module) -> bool:
    """Whether a model's decode and speculation steps may be captured: an exact model only where its
    attention takes models/exact_attention.py's kernel (no MLA, no sliding window, half precision);
    elsewhere it attends a call a token over the slots each sees, shapes from the host (models/exact.py).
    An MoE model only where its layers need no host sync at any token count (moe.capturable)."""
    c, p = model.config, next(model.parameters())
    if c.moe is not None and not moe.capturable(model.kernels, p.dtype, p.device):
        return False
    return not model.kernels.exact or (c.mla is None and c.sliding_window is None
                                       and p.dtype in (torch.bfloat16, torch.float16))
