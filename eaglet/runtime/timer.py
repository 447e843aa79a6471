"""Per-phase time of decoding steps (draft, verify, accept, decode) without host syncs on the
way: on the GPU each phase is bracketed by CUDA events that are read only when the totals are
asked for; on the CPU (where work is synchronous) by the wall clock. Asking folds the entries into
running totals, so a long run (training) that asks now and then keeps a bounded number of events.
A decoder takes it as its observer (runtime/observer.py): its steps' phases then run apart, each timed."""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch

from .observer import StepObserver


class PhaseTimer(StepObserver):
    apart = True

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.entries: list[tuple[str, object]] = []  # (phase, ms or (start event, end event)), not yet folded
        self.sums: dict[str, dict[str, float]] = defaultdict(lambda: {"ms": 0.0, "count": 0})

    @contextmanager
    def phase(self, name: str):
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            yield
            b.record()
            self.entries.append((name, (a, b)))
        else:
            t0 = time.perf_counter()
            yield
            self.entries.append((name, (time.perf_counter() - t0) * 1e3))

    def totals(self) -> dict[str, dict[str, float]]:
        """Per phase: total milliseconds and number of times it ran, since the start or reset()."""
        if self.cuda and self.entries:
            self.entries[-1][1][1].synchronize()  # sync: once, when the numbers are asked for
        for name, m in self.entries:
            self.sums[name]["ms"] += m[0].elapsed_time(m[1]) if isinstance(m, tuple) else m
            self.sums[name]["count"] += 1
        self.entries.clear()
        return {k: dict(v) for k, v in self.sums.items()}

    def reset(self) -> None:
        self.entries.clear()
        self.sums.clear()
