"""How eaglet's Triton kernels chain on the GPU: programmatic dependent launch, and counters for a
group's last program.

Dependent launch (compute capability 9+): a kernel launched with `launch_pdl` may start while the
kernel before it finishes, so its launch and ramp overlap that kernel's tail instead of following
it (a few microseconds a kernel, which at batch 1 is most of a small projection's time). Every such
kernel calls `gdc_launch_dependents()` first (the next may start) and `gdc_wait()` before it reads
anything the kernel before it wrote and before it writes anything (its output's memory may still be
read there); a kernel launched without it waits as usual.

Counters: a kernel whose programs each write a part of a result (the splits of an attention span,
the experts of a token) can finish the result itself instead of in a second kernel: each program
counts itself on its group's counter (release-acquire) and the one that counts last reads the
parts and writes the result, then zeroes the counter. The counters are zeroed once a device and
shared by every kernel that uses them (one stream: each call leaves them zero for the next).
"""
from __future__ import annotations

import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
COUNTERS = 1 << 16  # groups one call may count
_counters: dict[torch.device, torch.Tensor] = {}


def dependent_launch(x: torch.Tensor) -> bool:
    """Whether kernels on x's device launch dependently (compiled for the GPU, capability 9+)."""
    return not INTERPRET and x.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 9


def pdl(on: bool) -> dict:
    """The launch arguments of a kernel launched dependently where `on`."""
    return {"launch_pdl": True} if on else {}


def counters(x: torch.Tensor, groups: int) -> torch.Tensor | None:
    """x's device's zeroed counters for a call of `groups` groups (made on first use); None where
    there are too many groups, or the first use is inside a CUDA-graph capture (whose pool must not
    own them): the caller then finishes its results in a second kernel."""
    c = _counters.get(x.device)
    if c is None:
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        c = _counters[x.device] = torch.zeros(COUNTERS, dtype=torch.int32, device=x.device)
    return c if groups <= COUNTERS else None
