"""Small host values onto the device without a host sync."""
from __future__ import annotations

import threading

import torch

SLOTS, SLOT_BYTES = 64, 1 << 16


class PinnedRing:
    """Pinned host slots reused in turn for small copies to the device. A slot is refilled only
    once the copy that last read it has run (its event, recorded on the stream of the copy), so no
    copy reads a value written after it was queued. It replaces a fresh `pin_memory()` a copy: the
    caching host allocator's lookup and event bookkeeping were most of a small copy's host cost."""

    def __init__(self, device: torch.device, slots: int = SLOTS, slot_bytes: int = SLOT_BYTES):
        self.device = device
        self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(slots)]
        self.copied = [torch.cuda.Event() for _ in range(slots)]
        self.used = [False] * slots
        self.next = 0

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        if torch.cuda.is_current_stream_capturing():  # a captured copy would read the slot at every replay
            raise RuntimeError("to_device inside a CUDA-graph capture: copy into the graph's input buffers before it")
        nbytes = t.numel() * t.element_size()
        if nbytes > self.slots[0].numel():
            return t.pin_memory().to(self.device, non_blocking=True)
        i, self.next = self.next, (self.next + 1) % len(self.slots)
        if self.used[i]:
            self.copied[i].synchronize()  # host sync, but on a copy queued len(slots) copies ago: long done
        host = self.slots[i][:nbytes].view(t.dtype).view(t.shape)
        host.copy_(t)
        out = host.to(self.device, non_blocking=True)
        self.copied[i].record(torch.cuda.current_stream(self.device))  # the stream the copy ran on
        self.used[i] = True
        return out


_rings = threading.local()  # one ring per thread and device: the engine thread and a loader never share a slot


def _ring(device: torch.device) -> PinnedRing:
    if not hasattr(_rings, "by_device"):
        _rings.by_device = {}
    rings = _rings.by_device
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in rings:
        rings[key] = PinnedRing(torch.device("cuda", key))
    return rings[key]


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list, numpy array or CPU tensor on the device without a sync (through a pinned
    slot of this thread's ring; a value over a slot's size through a fresh pinned buffer)."""
    t = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t
    return _ring(device).to_device(t.contiguous())


INDEXES = 256  # row indexes each thread keeps on the device, the most recently used


def row_index(rows: list[int], device: torch.device) -> torch.Tensor:
    """`rows` as a long tensor on the device, copied once and kept (the last INDEXES sets, per
    thread): a server frees and refills the same few rows again and again, and a release indexes
    every cache and counter it touches with the same set (before, a copy to the device each). A kept
    tensor is never written, so reuse is always safe."""
    if not hasattr(_rings, "indexes"):
        _rings.indexes = {}
    kept, key = _rings.indexes, (device.type, device.index, tuple(rows))
    out = kept.pop(key, None)
    if out is None:
        out = to_device(rows, torch.long, device)
        if len(kept) >= INDEXES:
            del kept[next(iter(kept))]  # the least recently used
    kept[key] = out
    return out


def zero_rows(t: torch.Tensor, rows: list[int]) -> None:
    """t[rows] = 0 without a host sync. Indexing a CUDA tensor with a Python list, or building the
    index with torch.tensor(..., device=cuda), copies it from pageable memory, which waits for every
    kernel queued before it: on a server, the steps in flight."""
    t.index_fill_(0, row_index(rows, t.device), 0)
