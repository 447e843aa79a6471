"""Matmuls of a few rows (y = x Wᵀ + b for the tokens of a decode, draft or verify step) as Triton
kernels, used by models/linear.py on the GPU in place of cuBLAS.

At batch 1 a projection is a stream of weight bytes. cuBLAS picks kernels built for matrices (tiles
of 64 to 128 output rows, split-K with a second reduction kernel for the narrow ones) that reach
2.5 to 4.2 TB/s on the H200 for Llama-3.1-8B's projections; a GEMV with one program per output row,
reading the row in 1024-wide slices, reaches 3.5 to 4.5 TB/s on the same weights, and on SmolLM2's
small projections takes 1.7 to 2.9 µs where cuBLAS takes 3.3 to 5.2 (bench/gpu/layer_probe.py sweep,
BENCHMARKS.md). One row (decoding, drafting) takes that GEMV; 2 to MAX_ROWS rows (verify) a
tensor-core kernel that reads each weight tile once for all rows, where the sweep found it faster
than cuBLAS (by 3 to 22%; not for SmolLM2's head); longer inputs stay with cuBLAS. `glu` is the
MLP's gate-up with SiLU·mul in the same kernel: one kernel fewer per layer, 1.0 to 1.3 µs a layer
faster than the two apart on SmolLM2 and 1.2 to 2.3 µs on Llama-3.1-8B (`glu_tiles`). Sums run
in float32, so results differ from cuBLAS's by rounding only.

On compute capability 9 a one-row GEMV is launched dependent on the kernel before it (programmatic
dependent launch) and reads its first weight slices before it waits for its input; the kernels of a
decode step before one (the GEMVs, the norm kernel, the attention's combine) let it start as they
start, so its weights stream while they finish. A chain of 2048-wide GEMVs so launched (the probe's
tiles) took 3.3 µs a stage against 4.4 for this GEMV launched plainly, graphed
(bench/gpu/persist_probe.py, H100); decode on an H100: SmolLM2 1.17x, Qwen3-30B-A3B 1.03x,
Llama-3.1-8B 1.03x (BENCHMARKS.md).

Used where a model's `Kernels.gemv` is on (eaglet/kernels.py: float16 and bfloat16 on the GPU;
`--disable-kernels gemv` keeps cuBLAS for side-by-side runs). Under TRITON_INTERPRET=1 (the CPU
tests) it runs on any device.
"""
from __future__ import annotations

import os

import torch

from .cache_attention import dependent_launch, pow2

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without Triton
    triton = None

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MAX_ROWS = 16  # more rows go to cuBLAS: at 64 it matched the best tile of the sweep
PRE_SLICES = 2  # one row, launched dependent on the kernel before: weight slices read before waiting for x


def usable(x: torch.Tensor, weight: torch.Tensor, rows: int, glu: bool = False) -> bool:
    """Whether the kernels take this matmul (a model asks only where its Kernels.gemv is on)."""
    return (triton is not None and 1 <= rows <= MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and weight.is_contiguous() and not torch.is_grad_enabled()
            and (x.is_cuda or INTERPRET) and (rows == 1 or glu or dot_tiles(rows, *weight.shape) is not None))


def tiles(n: int, k: int) -> tuple[int, int, int]:
    """The GEMV's (output rows per program, slice width, warps), from the sweep on the H200: for
    Llama-3.1-8B's widths one row per program in 1024-wide slices with 8 warps is within 2.3% of the
    best tile on every projection; SmolLM2's narrow ones (576, 1536) do best with two rows (four for
    the 49152-row head) and the whole width in one slice. At width 2048 exactly (Qwen3-30B-A3B's and
    DeepSeek-V2-Lite's hidden size) two rows (four for a head) in one slice: Qwen3's q/k/v 6.5 µs
    against 7.7, its head 140 against 172 (the H200 sweep); decode 0.5% faster on Qwen3, 0.2% on
    DeepSeek-V2-Lite (H100, side by side; docs/notebook.md)."""
    if k == 2048:
        return (4 if n >= 16384 else 2), 2048, 8
    if k > 2048:
        return 1, 1024, 8
    bk = max(64, pow2(k))
    return (4 if n >= 16384 else 2), bk, 4 if bk >= 2048 else 2


def dot_tiles(rows: int, n: int, k: int) -> tuple[int, int, int, int, int] | None:
    """The tensor-core kernel's (row tile, output columns per program, slice width, warps, stages) for
    2 to MAX_ROWS rows, or None where cuBLAS was as fast. From the sweep at 6 and 16 rows: Llama-3.1-8B's
    14336-wide down projection and the 4096-row ones take 512-wide slices, the wide gate-up and head
    128-wide ones in three stages, 64 columns as q/k/v (the head 1.02-1.07x faster than with 32 at
    2-16 rows, gate-up within 1%: gemv-sweep-gpu-20261130-073651/-092559.json); SmolLM2's narrow
    ones 16 to 32 columns."""
    if k >= 2048:
        if k >= 8192 or n <= 4096:
            return 16, 32, 512, 4, 4
        return (16, 64, 128, 4, 3) if n >= 16384 else (16, 64, 256, 4, 4)
    if n >= 16384:
        return None
    if n >= 2048:
        return 16, 32, min(128, max(16, pow2(k))), 4, 4
    return (16, 16, 512, 4, 4) if k > 1024 else (16, 16, min(256, max(16, pow2(k))), 4, 3)


def glu_tiles(rows: int, k: int) -> tuple[int, ...]:
    """`glu`'s tiles (as `tiles` for one row, `dot_tiles` for more), per gate row and its up row. From
    bench/gpu/layer_probe.py glu on the H200 (glu-sweep-gpu-20261130-104834/-104923.json): Llama-3.1-8B's
    gate-up at 1 / 2 / 16 rows 53.3 / 58.2 / 59.0 µs against 54.5 / 59.7 / 61.4 for the matmul and the
    compiled SiLU·mul (at 2-16 rows 128-wide slices rather than 256: within 1% on Llama, 0.28 ms a
    16-token forward faster on Qwen3-8B, bench-shape-qwen3-8b-gpu-20261130-110525/-110631.json);
    SmolLM2's at 1 / 6 / 16 rows 3.0 / 4.2 / 4.3 µs against 4.0 / 5.5 / 5.5."""
    if rows == 1:
        return (1, 2048, 8) if k >= 2048 else (1, max(64, min(256, pow2(k))), 4)
    return (16, 32, 128, 4, 3) if k >= 2048 else (16, 32, min(128, max(16, pow2(k))), 4, 4)


def exact_tiles(n: int, k: int, glu: bool) -> tuple[int, int, int, int, int]:
    """The row-invariant kernel's tiles, from the weight's shape alone: `dot_tiles` / `glu_tiles` as
    2 to 16 rows take them, and for the shapes cuBLAS keeps (wide outputs of a narrow K: SmolLM2's
    head) 64 columns in 128-wide slices."""
    if glu:
        return glu_tiles(2, k)
    return dot_tiles(2, n, k) or (16, 64, min(128, max(16, pow2(k))), 4, 3)


def exact(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, glu: bool = False) -> torch.Tensor:
    """`gemv` (or with `glu`, `glu`) for any number of rows with each row reduced alike whatever the
    others (`Kernels.exact` on the GPU): tiles of 16 rows, the K loop and tile fixed by the weight's
    shape (`exact_tiles`), no split-K; a row's result is the same bits alone, among a verify's rows or
    in a batch."""
    return _run(x, weight, bias, glu, exact=True)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) holding 1 to MAX_ROWS rows, weight (N, K) contiguous, bias (N,) or None -> (..., N)."""
    return torch.ops.eaglet.gemv(x, weight, bias)


def glu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The MLP's gate-up and SiLU·mul in one kernel: weight (2I, K) the gate rows then the up rows
    (bias likewise) -> silu(gate) * up (..., I). Each program reads its gate rows and the matching
    up rows, rounds both products to x's dtype (as the separate matmul would) and multiplies."""
    return torch.ops.eaglet.gemv_glu(x, weight, bias)


def _run(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, glu: bool, exact: bool = False) -> torch.Tensor:
    n, k = weight.shape
    xr = x.reshape(-1, k)
    if xr.stride(1) != 1:
        xr = xr.contiguous()
    m = xr.shape[0]
    out = n // 2 if glu else n  # output columns; with glu each program also reads the rows `out` further on
    y = torch.empty(m, out, dtype=x.dtype, device=x.device)
    b = bias if bias is not None else y  # not read
    if exact:
        bm, bn, bk, warps, stages = exact_tiles(n, k, glu)
        gemv_dot_kernel[(triton.cdiv(out, bn), triton.cdiv(m, bm))](
            xr, weight, b, y, m, out, xr.stride(0), K=k, BM=bm, BN=bn, BK=bk, EVEN_K=k % bk == 0,
            HAS_BIAS=bias is not None, GLU=glu, num_warps=warps, num_stages=stages)
    elif m == 1:
        bn, bk, warps = glu_tiles(1, k) if glu else tiles(n, k)
        # launched dependent on the kernel before: where that one lets dependents start early (the GEMVs,
        # the attention's combine, the norm kernel) the first weight slices stream while it finishes
        pdl = dependent_launch(x)
        pre = min(PRE_SLICES, triton.cdiv(k, bk)) if pdl else 0
        gemv_kernel[(triton.cdiv(out, bn),)](xr, weight, b, y, out, K=k, BN=bn, BK=bk, EVEN_K=k % bk == 0,
                                         HAS_BIAS=bias is not None, GLU=glu, TRIGGER=pdl, PRE=pre,
                                         num_warps=warps, **({"launch_pdl": True} if pre else {}))
    else:
        bm, bn, bk, warps, stages = glu_tiles(m, k) if glu else dot_tiles(m, n, k)
        pdl = dependent_launch(x)  # as one row, with the first slice (the most PRE takes here) read before waiting for x
        gemv_dot_kernel[(triton.cdiv(out, bn),)](xr, weight, b, y, m, out, xr.stride(0), K=k, BM=bm, BN=bn, BK=bk,
                                             EVEN_K=k % bk == 0, HAS_BIAS=bias is not None, GLU=glu,
                                             TRIGGER=pdl, PRE=int(pdl), num_warps=warps, num_stages=stages,
                                             **({"launch_pdl": True} if pdl else {}))
    return y.view(*x.shape[:-1], out)


@torch.library.custom_op("eaglet::gemv", mutates_args=())
def _gemv_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _run(x, weight, bias, False)


@_gemv_op.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("eaglet::gemv_glu", mutates_args=())
def _glu_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _run(x, weight, bias, True)


@_glu_op.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0] // 2)


if triton is not None:
    @triton.jit
    def _silu_mul(g, u, dtype: tl.constexpr):
        """silu(g) * u of two float32 products, each first rounded to `dtype` like a matmul's output."""
        g = g.to(dtype).to(tl.float32)
        return g * tl.sigmoid(g) * u.to(dtype).to(tl.float32)

    @triton.jit
    def _slice(W, rows, rm, cols, K: tl.constexpr, EVEN_K: tl.constexpr):
        """Rows `rows` of W at columns `cols` (masked past N, and past K unless EVEN_K)."""
        wm = rm[:, None] if EVEN_K else rm[:, None] & (cols < K)[None, :]
        return tl.load(W + rows[:, None] * K + cols[None, :], mask=wm, other=0.0, eviction_policy="evict_first")

    @triton.jit
    def _times_x(acc, w, X, cols, K: tl.constexpr, EVEN_K: tl.constexpr):
        x = tl.load(X + cols) if EVEN_K else tl.load(X + cols, mask=cols < K, other=0.0)
        return acc + w.to(tl.float32) * x[None, :].to(tl.float32)

    @triton.jit
    def gemv_kernel(X, W, B, Y, N, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                HAS_BIAS: tl.constexpr, GLU: tl.constexpr, TRIGGER: tl.constexpr, PRE: tl.constexpr = 0):
        """Y (N,) = W X (+ B) for one row X; with GLU, silu(W[:N] X) * (W[N:] X). TRIGGER: a kernel launched
        dependent on this one (the next GEMV, the routing kernel) may start now and read its weights; it
        waits for these results before reading them. PRE (1-2): this one is so launched, and reads its
        first PRE weight slices (with GLU, and their up rows) before it waits for X."""
        if TRIGGER:
            tl.extra.cuda.gdc_launch_dependents()
        rows = tl.program_id(0) * BN + tl.arange(0, BN)
        rm = rows < N
        c0 = tl.arange(0, BK)
        if PRE > 0:  # launched dependent: the first slices' weights do not depend on the kernel before
            w0 = _slice(W, rows, rm, c0, K, EVEN_K)
            if GLU:
                u0 = _slice(W, rows + N, rm, c0, K, EVEN_K)
        if PRE > 1:
            w1 = _slice(W, rows, rm, BK + c0, K, EVEN_K)
            if GLU:
                u1 = _slice(W, rows + N, rm, BK + c0, K, EVEN_K)
        if PRE > 0:  # X, complete and visible
            tl.extra.cuda.gdc_wait()
        acc = tl.zeros((BN, BK), dtype=tl.float32)
        acc2 = tl.zeros((BN, BK), dtype=tl.float32)  # the up rows (GLU)
        if PRE > 0:  # the same slices in the same order as the loop's
            acc = _times_x(acc, w0, X, c0, K, EVEN_K)
            if GLU:
                acc2 = _times_x(acc2, u0, X, c0, K, EVEN_K)
        if PRE > 1:
            acc = _times_x(acc, w1, X, BK + c0, K, EVEN_K)
            if GLU:
                acc2 = _times_x(acc2, u1, X, BK + c0, K, EVEN_K)
        for k0 in range(PRE * BK, K, BK):
            cols = k0 + c0
            x = tl.load(X + cols) if EVEN_K else tl.load(X + cols, mask=cols < K, other=0.0)
            acc += _slice(W, rows, rm, cols, K, EVEN_K).to(tl.float32) * x[None, :].to(tl.float32)
            if GLU:
                acc2 += _slice(W, rows + N, rm, cols, K, EVEN_K).to(tl.float32) * x[None, :].to(tl.float32)
        y = tl.sum(acc, 1)
        if HAS_BIAS:
            y += tl.load(B + rows, mask=rm, other=0.0).to(tl.float32)
        if GLU:
            y2 = tl.sum(acc2, 1)
            if HAS_BIAS:
                y2 += tl.load(B + N + rows, mask=rm, other=0.0).to(tl.float32)
            y = _silu_mul(y, y2, Y.dtype.element_ty)
        tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=rm)

    @triton.jit
    def gemv_dot_kernel(X, W, B, Y, M, N, sx, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, GLU: tl.constexpr, TRIGGER: tl.constexpr = False,
                    PRE: tl.constexpr = 0):
        """Y (M, N) = X (M, K) Wᵀ (+ B), rows in tiles of BM (the grid's second axis): each program
        streams BN rows of W once for its tile (with GLU also the BN rows N further on, and writes
        silu(first) * second). TRIGGER and PRE (0-1) as gemv_kernel's: dependents may start at once;
        launched dependent, the first slice's weights read before waiting for X."""
        if TRIGGER:
            tl.extra.cuda.gdc_launch_dependents()
        m = tl.program_id(1) * BM + tl.arange(0, BM)
        cols = tl.program_id(0) * BN + tl.arange(0, BN)
        mm, cm = m < M, cols < N
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        acc2 = tl.zeros((BM, BN), dtype=tl.float32)
        if PRE > 0:  # the loop's first step, its weights read before the wait
            c0 = tl.arange(0, BK)
            w0 = _slice(W, cols, cm, c0, K, EVEN_K)
            if GLU:
                u0 = _slice(W, cols + N, cm, c0, K, EVEN_K)
            tl.extra.cuda.gdc_wait()
            xm = mm[:, None] if EVEN_K else mm[:, None] & (c0 < K)[None, :]
            x = tl.load(X + m[:, None] * sx + c0[None, :], mask=xm, other=0.0)
            acc = tl.dot(x, tl.trans(w0), acc)
            if GLU:
                acc2 = tl.dot(x, tl.trans(u0), acc2)
        for k0 in range(PRE * BK, K, BK):
            kk = k0 + tl.arange(0, BK)
            xm = mm[:, None] if EVEN_K else mm[:, None] & (kk < K)[None, :]
            wm = cm[:, None] if EVEN_K else cm[:, None] & (kk < K)[None, :]
            x = tl.load(X + m[:, None] * sx + kk[None, :], mask=xm, other=0.0)
            w = tl.load(W + cols[:, None] * K + kk[None, :], mask=wm, other=0.0, eviction_policy="evict_first")
            acc = tl.dot(x, tl.trans(w), acc)
            if GLU:
                w2 = tl.load(W + (cols + N)[:, None] * K + kk[None, :], mask=wm, other=0.0,
                             eviction_policy="evict_first")
                acc2 = tl.dot(x, tl.trans(w2), acc2)
        if HAS_BIAS:
            acc += tl.load(B + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
        if GLU:
            if HAS_BIAS:
                acc2 += tl.load(B + N + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
            acc = _silu_mul(acc, acc2, Y.dtype.element_ty)
        tl.store(Y + m[:, None] * N + cols[None, :], acc.to(Y.dtype.element_ty), mask=mm[:, None] & cm[None, :])
