"""The k best entries of each row, as one Triton kernel: what the EAGLE-2 tree takes at every level
(a frontier node's best children by log-probability, the next frontier among them) and at its end
(the best nodes of all candidates).

torch.topk over a draft vocabulary of 16,384 took 48 µs for 4 rows and 84 µs for 8 on the H200, and
with the softmax and sorts around it about half of a 5- or 6-level tree's draft step (754 and 1060
µs; 433 and 601 with this kernel: bench/gpu/step_profile.py, BENCHMARKS.md); here one
program per row holds the row in registers, takes its log-softmax if asked, and picks the k largest
one by one. Ties go to the lower index, as a stable descending sort's first k (select_tree needs
that, and asks the fallback for the sort); the fallback otherwise is torch.topk, whose order of ties
is its own.

A row of SPLIT_WIDTH or more (a draft vocabulary) is cut over programs instead of held by one:
one row on one SM took 8.9 µs at 16,384 wide, its k block-wide reductions one after another. Each
CHUNK-wide piece gives its own k best (and its max and sum of exponentials), and a second kernel
picks the row's k best among those: the same picks, ties included (the k best of a row are among
its pieces' k best, each taken lowest index first), and the log-softmax from the pieces' sums.

Used where a model's `Kernels.topk` is on (eaglet/kernels.py: the GPU); under TRITON_INTERPRET=1
(the CPU tests) on any device.
"""
from __future__ import annotations

import torch

from ..models.cache_attention import INTERPRET, pow2

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without Triton
    triton = None

MAX_WIDTH = 1 << 16  # wider rows (a full 128k vocabulary) would spill registers: torch.topk
MAX_K = 64
SPLIT_WIDTH = 4096  # rows at least this wide take the two-kernel path
CHUNK = 1024


def usable(x: torch.Tensor, k: int) -> bool:
    """Whether the kernel takes these rows (callers ask only where Kernels.topk is on)."""
    return (triton is not None and (x.is_cuda or INTERPRET) and 1 <= k <= min(MAX_K, x.shape[-1])
            and x.shape[-1] <= MAX_WIDTH and not (x.requires_grad and torch.is_grad_enabled()))


def topk(x: torch.Tensor, k: int, log_softmax: bool = False, stable: bool = False,
         offset: torch.Tensor | None = None, kernel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(values float32, indices int64), each (..., k): the k largest of x along its last dim, largest
    first; with `log_softmax`, of x.float().log_softmax(-1); `stable`: ties to the lower index on
    every path (the kernel always does). `offset` (x.shape[:-1], float32) is added to each row's
    values (a tree node's children: their log-probabilities plus the node's score); the order of a
    row does not change with it. `kernel`: the Triton kernel where it can (Kernels.topk), torch.topk
    otherwise."""
    if not (kernel and usable(x, k)):
        y = x.float().log_softmax(-1) if log_softmax else x.float()
        if stable:
            v, i = y.sort(dim=-1, descending=True, stable=True)
            v, i = v[..., :k], i[..., :k]
        else:
            v, i = y.topk(k, -1)
        return (v if offset is None else v + offset[..., None]), i
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    vals = torch.empty(rows.shape[0], k, dtype=torch.float32, device=x.device)
    idx = torch.empty(rows.shape[0], k, dtype=torch.long, device=x.device)
    off = vals if offset is None else offset.reshape(-1).float()  # not read without an offset
    assert offset is None or off.numel() == rows.shape[0]
    m = rows.shape[0]
    if n >= SPLIT_WIDTH:
        nc = triton.cdiv(n, CHUNK)
        part_v = torch.empty(m, nc, k, dtype=torch.float32, device=x.device)
        part_i = torch.empty(m, nc, k, dtype=torch.long, device=x.device)
        stats = torch.empty(m, nc, 2, dtype=torch.float32, device=x.device)  # each piece's max, sum of exp
        chunk_topk_kernel[(m, nc)](rows, part_v, part_i, stats, n, rows.stride(0), K=k, CHUNK=CHUNK,
                             LOG_SOFTMAX=log_softmax, num_warps=4)
        merge_topk_kernel[(m,)](part_v, part_i, stats, vals, idx, off, n, nc, K=k, BLOCK=max(16, pow2(nc * k)),
                          CB=max(16, pow2(nc)), LOG_SOFTMAX=log_softmax, OFFSET=offset is not None, num_warps=1)
    else:
        block = max(16, pow2(n))
        # 16 warps for a 16,384-wide row: 8.9 µs against 10.1 with 8 (H200, topk-probe-gpu-20261130-170009.json)
        row_topk_kernel[(m,)](rows, vals, idx, off, n, rows.stride(0), K=k, BLOCK=block, LOG_SOFTMAX=log_softmax,
                        OFFSET=offset is not None, num_warps=min(16, max(1, block // 1024)))
    return vals.view(*x.shape[:-1], k), idx.view(*x.shape[:-1], k)


if triton is not None:
    @triton.jit
    def row_stats(x_ptr, n, stride, BLOCK: tl.constexpr, LOG_SOFTMAX: tl.constexpr):
        """This program's row in float32 (-inf past n), its lanes, which are live, its max, and
        log(sum(exp(x - max))) when LOG_SOFTMAX (log_softmax(x) = (x - max) - that), else 0."""
        offs = tl.arange(0, BLOCK)
        live = offs < n
        x = tl.load(x_ptr + tl.program_id(0) * stride + offs, mask=live, other=-float("inf")).to(tl.float32)
        top = tl.max(x, 0)
        lse = 0.0
        if LOG_SOFTMAX:
            lse = tl.log(tl.sum(tl.where(live, tl.exp(x - top), 0.0), 0))
        return x, offs, live, top, lse

    @triton.jit
    def row_topk_kernel(x_ptr, val_ptr, idx_ptr, off_ptr, n, stride, K: tl.constexpr, BLOCK: tl.constexpr,
                  LOG_SOFTMAX: tl.constexpr, OFFSET: tl.constexpr):
        row = tl.program_id(0)
        x, offs, live, top, lse = row_stats(x_ptr, n, stride, BLOCK, LOG_SOFTMAX)
        shift = 0.0
        if OFFSET:
            shift = tl.load(off_ptr + row)
        for j in tl.static_range(K):
            best = tl.max(tl.where(live, x, -float("inf")), 0)
            at = tl.min(tl.where(live & (x == best), offs, BLOCK), 0)  # the lowest index holding it
            at = tl.minimum(at, n - 1)  # NaN matches nothing: keep the index in range
            if LOG_SOFTMAX:
                best = (best - top) - lse
            tl.store(val_ptr + row * K + j, best + shift)
            tl.store(idx_ptr + row * K + j, at.to(tl.int64))
            live = live & (offs != at)

    @triton.jit
    def chunk_topk_kernel(x_ptr, part_v, part_i, stats, n, stride, K: tl.constexpr, CHUNK: tl.constexpr,
                    LOG_SOFTMAX: tl.constexpr):
        """One CHUNK-wide piece of a row: its k largest raw values with their row indices, lowest
        index first among equals (a piece with fewer than k entries pads with -inf at indices n,
        n + 1, ..., which lose every tie to a real entry), and its max and sum(exp(x - max))."""
        row, c, nc = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
        offs = c * CHUNK + tl.arange(0, CHUNK)
        live = offs < n
        x = tl.load(x_ptr + row * stride + offs, mask=live, other=-float("inf")).to(tl.float32)
        slot = row * nc + c
        if LOG_SOFTMAX:
            top = tl.max(x, 0)
            total = tl.sum(tl.where(live, tl.exp(x - top), 0.0), 0)
            tl.store(stats + slot * 2, top)
            tl.store(stats + slot * 2 + 1, tl.where(top == -float("inf"), 0.0, total))  # an all -inf piece adds 0
        for j in tl.static_range(K):
            best = tl.max(tl.where(live, x, -float("inf")), 0)
            at = tl.min(tl.where(live & (x == best), offs, n + K + CHUNK), 0)
            at = tl.where(at >= n, n + j, at)  # none left (or NaN): a padding entry
            tl.store(part_v + slot * K + j, best)
            tl.store(part_i + slot * K + j, at.to(tl.int64))
            live = live & (offs != at)

    @triton.jit
    def merge_topk_kernel(part_v, part_i, stats, val_ptr, idx_ptr, off_ptr, n, nc, K: tl.constexpr, BLOCK: tl.constexpr,
                    CB: tl.constexpr, LOG_SOFTMAX: tl.constexpr, OFFSET: tl.constexpr):
        """A row's k best among its pieces' (as row_topk_kernel picks them), log-softmaxed with the row's
        max and log(sum(exp(x - max))) gathered from the pieces'."""
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        live = offs < nc * K
        v = tl.load(part_v + row * nc * K + offs, mask=live, other=-float("inf"))
        ix = tl.load(part_i + row * nc * K + offs, mask=live, other=n + K)
        top = 0.0
        lse = 0.0
        if LOG_SOFTMAX:
            co = tl.arange(0, CB)
            cl = co < nc
            m = tl.load(stats + (row * nc + co) * 2, mask=cl, other=-float("inf"))
            s = tl.load(stats + (row * nc + co) * 2 + 1, mask=cl, other=0.0)
            top = tl.max(m, 0)
            lse = tl.log(tl.sum(tl.where(cl, s * tl.exp(m - top), 0.0), 0))
        shift = 0.0
        if OFFSET:
            shift = tl.load(off_ptr + row)
        for j in tl.static_range(K):
            best = tl.max(tl.where(live, v, -float("inf")), 0)
            at = tl.min(tl.where(live & (v == best), ix, n + 2 * K), 0)
            live = live & (ix != at)
            if LOG_SOFTMAX:
                best = (best - top) - lse
            tl.store(val_ptr + row * K + j, best + shift)
            tl.store(idx_ptr + row * K + j, tl.minimum(at, n - 1))  # NaN matches nothing: keep the index in range
