"""Small host values onto the device without a host sync."""
from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list or numpy array on the device without a sync (a fresh pinned buffer: the
    caching host allocator reuses it only after the copy has run)."""
    t = torch.as_tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def zero_rows(t: torch.Tensor, rows: list[int]) -> None:
    """t[rows] = 0 without a host sync. Indexing a CUDA tensor with a Python list, or building the
    index with torch.tensor(..., device=cuda), copies it from pageable memory, which waits for every
    kernel queued before it: on a server, the steps in flight."""
    t.index_fill_(0, to_device(rows, torch.long, t.device), 0)
