"""MLA's two per-head matmuls around the latent attention, for one token (a decode or drafting step of
one row), as Triton kernels in place of cuBLAS's batched matmul (models/mla.py's absorbed form):

- `absorb`: q_lat[h] = q_nope[h] W_k[h], each head's query folded into latent space through
  kv_b_proj's key rows (W_k[h]: nope x C, the sum over the nope rows);
- `values`: o[h] = W_v[h] o_lat[h], the attention-weighted latent through kv_b_proj's value rows
  (W_v[h]: v x C, the sum over C: a GEMV per head).

At one token each is a few MB of weights (2 MB a matmul for DeepSeek-V2-Lite's 16 heads) and cuBLAS's
batched matmul cannot let the next kernel start early nor start early itself. These do both on
compute capability 9, as the one-row GEMVs do (models/gemv.py): each triggers its dependents at its
start and, launched dependent on the kernel before, reads its weight tile before it waits for its
input; `values` is followed by the o projection's GEMV, which then streams its weights while `values`
finishes. Sums in float32, so results differ from cuBLAS's by rounding only.
"""
from __future__ import annotations

import torch

from .cache_attention import INTERPRET, dependent_launch, pow2, triton

if triton is not None:
    import triton.language as tl

ABSORB_COLS = 64  # latent columns a program of `absorb` (all the head's nope rows)
VALUE_ROWS = 16  # value rows a program of `values` (all the latent's columns)


def usable(x: torch.Tensor, rows: int, nope: int, c: int) -> bool:
    """Whether the kernels take a step of `rows` tokens (one), nope and latent widths powers of two."""
    return (triton is not None and rows == 1 and x.dtype in (torch.bfloat16, torch.float16)
            and (x.is_cuda or INTERPRET) and pow2(nope) == nope and pow2(c) == c)


def absorb(q_nope: torch.Tensor, w: torch.Tensor, nope: int) -> torch.Tensor:
    """q_nope (nh, nope) with unit last stride; w (nh, nope + v, C) kv_b_proj's weight by head -> q_lat
    (nh, C) = q_nope[h] @ w[h, :nope]."""
    nh, _, c = w.shape
    out = q_nope.new_empty(nh, c)
    pdl = dependent_launch(q_nope)
    bc = min(ABSORB_COLS, c)
    absorb_kernel[(nh, c // bc)](q_nope, w, out, q_nope.stride(0), ROW=w.stride(0), D=nope, C=c, BC=bc, PDL=pdl,
                                 num_warps=4, **({"launch_pdl": True} if pdl else {}))
    return out


def values(o_lat: torch.Tensor, w: torch.Tensor, nope: int, out: torch.Tensor) -> torch.Tensor:
    """o_lat (nh, C) contiguous; w (nh, nope + v, C) -> out (nh, v) (contiguous) = w[h, nope:] @ o_lat[h]."""
    nh, dv, c = w.shape
    v = dv - nope
    pdl = dependent_launch(o_lat)
    values_kernel[(nh, triton.cdiv(v, VALUE_ROWS))](o_lat, w, out, V=v, ROW=w.stride(0), D=nope, C=c,
                                                    BV=VALUE_ROWS, PDL=pdl, num_warps=4,
                                                    **({"launch_pdl": True} if pdl else {}))
    return out


if triton is not None:
    @triton.jit
    def absorb_kernel(X, W, Y, sx, ROW: tl.constexpr, D: tl.constexpr, C: tl.constexpr, BC: tl.constexpr,
                      PDL: tl.constexpr):
        """Y[h, cols] = sum over d of X[h, d] W[h, d, cols]: program (head, BC columns). PDL: launched
        dependent, so the weight tile is read before waiting for X, and dependents may start now."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        h = tl.program_id(0)
        cols = tl.program_id(1) * BC + tl.arange(0, BC)
        d = tl.arange(0, D)
        w = tl.load(W + h * ROW + d[:, None] * C + cols[None, :], eviction_policy="evict_first")
        if PDL:
            tl.extra.cuda.gdc_wait()
        x = tl.load(X + h * sx + d)
        y = tl.sum(w.to(tl.float32) * x[:, None].to(tl.float32), 0)
        tl.store(Y + h * C + cols, y.to(Y.dtype.element_ty))

    @triton.jit
    def values_kernel(X, W, Y, V, ROW: tl.constexpr, D: tl.constexpr, C: tl.constexpr, BV: tl.constexpr,
                      PDL: tl.constexpr):
        """Y[h, rows] = W[h, D + rows, :] X[h]: program (head, BV value rows), the whole latent at once.
        PDL as absorb_kernel's."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        h = tl.program_id(0)
        rows = tl.program_id(1) * BV + tl.arange(0, BV)
        rm = rows < V
        c = tl.arange(0, C)
        w = tl.load(W + h * ROW + (D + rows)[:, None] * C + c[None, :], mask=rm[:, None], other=0.0,
                    eviction_policy="evict_first")
        if PDL:
            tl.extra.cuda.gdc_wait()
        x = tl.load(X + h * C + c)
        y = tl.sum(w.to(tl.float32) * x[None, :].to(tl.float32), 1)
        tl.store(Y + h * V + rows, y.to(Y.dtype.element_ty), mask=rm)
