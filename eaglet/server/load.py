"""The load the speculation policy reads: the most requests the server held at once lately
(engine.py explains why a peak, not the instant count, and why 30 s)."""
from __future__ import annotations

import time
from collections import deque

LOAD_WINDOW = 30.0  # seconds the policy remembers a load peak for


class LoadMeter:
    """The most requests (running + waiting) seen at once over the last `window` seconds."""

    def __init__(self, window: float = LOAD_WINDOW):
        self.window = window
        self.samples: deque[tuple[float, int]] = deque()  # (time, count), counts decreasing

    def note(self, n: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        while self.samples and self.samples[-1][1] <= n:  # a later, larger count outlives smaller ones
            self.samples.pop()
        self.samples.append((now, n))
        while self.samples[0][0] < now - self.window:
            self.samples.popleft()

    def peak(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        while self.samples and self.samples[0][0] < now - self.window:
            self.samples.popleft()
        return self.samples[0][1] if self.samples else 0
