"""An all-reduce latency curve read back from an `eaglet bench-comm` record, for the planner: the
time of one all-reduce of any byte count, interpolated log-log between the measured sizes."""
from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidInput


@dataclass(frozen=True)
class AllReduceCurve:
    """Measured (bytes, µs) points of one all-reduce over `world` ranks, bytes increasing; eager
    calls, or all-reduces replayed inside a CUDA graph (`graph`)."""
    world: int
    graph: bool
    bytes: tuple[int, ...]
    us: tuple[float, ...]

    def latency_us(self, nbytes: float) -> float:
        """One all-reduce of `nbytes`: a straight line between its neighbours on log-log axes. Below
        the smallest size, that size's latency (a fixed cost no smaller message escapes); above the
        largest, the largest size's bandwidth (big messages are bandwidth-bound)."""
        b, t = self.bytes, self.us
        if nbytes <= b[0]:
            return t[0]
        if nbytes >= b[-1]:
            return t[-1] * nbytes / b[-1]
        i = bisect.bisect_right(b, nbytes)  # b[i - 1] <= nbytes < b[i]
        f = math.log(nbytes / b[i - 1]) / math.log(b[i] / b[i - 1])
        return t[i - 1] * (t[i] / t[i - 1]) ** f


def load_curve(path: str | Path, graph: bool = False) -> AllReduceCurve:
    """The eager (or CUDA-graph) latency curve of a bench-comm record: the max over ranks per size."""
    rec = json.loads(Path(path).read_text())
    if rec.get("kind") != "bench-comm":
        raise InvalidInput(f"{path}: not a bench-comm record (kind {rec.get('kind')!r})")
    res = rec["results"]
    col = "graph_us" if graph else "eager_us"
    rows = sorted(res["rows"], key=lambda r: r["bytes"])
    if not rows or any(r[col] is None for r in rows):
        raise InvalidInput(f"{path}: no {col} latencies in this record (backend {res.get('backend')})")
    if any(not r[col] > 0 for r in rows):
        raise InvalidInput(f"{path}: a {col} latency is not positive")
    return AllReduceCurve(res["world"], graph, tuple(r["bytes"] for r in rows), tuple(r[col] for r in rows))
