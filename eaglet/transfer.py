"""Small host values onto the device without a host sync."""
from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list or numpy array on the device without a sync (a fresh pinned buffer: the
    caching host allocator reuses it only after the copy has run)."""
    t = torch.as_tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t
