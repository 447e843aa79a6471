"""Per-phase time of decoding steps (draft, verify, accept, decode) without host syncs on the
way: on the GPU each phase is bracketed by CUDA events that are read only when the totals are
asked for; on the CPU (where work is synchronous) by the wall clock."""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch


class PhaseTimer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.entries: list[tuple[str, object]] = []  # (phase, ms or (start event, end event))

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
        """Per phase: total milliseconds and number of times it ran."""
        if self.cuda and self.entries:
            self.entries[-1][1][1].synchronize()  # sync: once, when the numbers are asked for
        out: dict[str, dict[str, float]] = defaultdict(lambda: {"ms": 0.0, "count": 0})
        for name, m in self.entries:
            out[name]["ms"] += m[0].elapsed_time(m[1]) if isinstance(m, tuple) else m
            out[name]["count"] += 1
        return dict(out)
