"""Attention with the same reduction order for a token whatever else is in the call (`Kernels.exact`,
`--exact`; the CPU's path): each new token of each row attends alone over exactly the cache slots its
mask shows, in slot order, as a one-token decode of that token would. A verified token then gets
bitwise the logits of the decode step that would have produced it, and a row the logits it gets
alone, whoever shares its batch: SDPA over a block of queries with masked keys sums in another
order (bench/cpu/verify_invariance.py). The projections, norms, MoE layers and output layer around
it are row-invariant on the CPU already (eaglet's matmuls reduce each row alike at any row count).
On the GPU cuBLAS and torch's reductions choose their tiling by the row count, so an exact model
there runs gemv.py's row-invariant matmul (models/linear.py) and `rms_norm` below, one program a
row (which every model's few-row norms take on the GPU as well: `chained_norm`); the fused MoE
kernels reduce a token alike at any count already; attention runs as models/exact_attention.py's
kernels (no host sync: graphed), MLA's as here, a call a token, whose
shapes are the same in a verify and in the decode step (host syncs: eager).

Forwards of up to EXACT_TOKENS tokens over the cache (decode, draft, verify) take this path. A
prefill (AttnMeta.prompt_lens set) attends each row over its own prompt, causally, in one call of
exactly its length: the same whatever the padding of the batch it was admitted with."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .cache_attention import dependent_launch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without Triton
    triton = None

EXACT_TOKENS = 64


def applies(meta, tokens: int) -> bool:
    return meta is not None and meta.kernels.exact and tokens <= EXACT_TOKENS


def visible(meta) -> list[list[slice | torch.Tensor]]:
    """For each row b and new token t, the cache slots it sees (meta.mask[b, 0, t]), ascending: a
    slice where they run unbroken from slot 0 (a decode, a chain; no copy), else their indices (a
    tree). Made once per forward and shared by the layers (one host sync)."""
    if meta._visible is None:
        mask = meta.mask[:, 0].cpu()  # sync: the slots decide the calls' shapes
        if meta.prompt_lens is not None:  # a prefill: no padding key is seen
            mask = mask & (torch.arange(mask.shape[-1]) < torch.tensor(meta.prompt_lens)[:, None])[:, None]

        def slots(seen: torch.Tensor) -> slice | torch.Tensor:
            idx = seen.nonzero()[:, 0]
            n = idx.numel()
            return slice(0, n) if n == 0 or int(idx[-1]) == n - 1 else idx.to(meta.mask.device)
        meta._visible = [[slots(row[t]) for t in range(row.shape[0])] for row in mask]
    return meta._visible


def attend_rows(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, meta) -> torch.Tensor:
    """kvcache.attend_masked's result (B, H, T, D) from q (B, Hkv, G*T, D) and keys, values
    (B, Hkv, S, D): one SDPA call a token over its visible slots."""
    b, hkv, gt, d = q.shape
    t = meta.slots.shape[1]
    g = gt // t
    qv = q.view(b, hkv, g, t, d)
    out = q.new_empty(b, hkv, g, t, d)
    for i, row in enumerate(visible(meta)):
        for j, idx in enumerate(row):
            out[i, :, :, j] = F.scaled_dot_product_attention(qv[i, :, :, j], keys[i][:, idx], vals[i][:, idx])
    return out.reshape(b, hkv * g, t, d)


def attend_prompts(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, meta) -> torch.Tensor:
    """A prefill's attention (B, H, T, D) from q (B, Hkv, G*T, D), keys and values (B, Hkv, T, D):
    row b's first prompt_lens[b] tokens causally among themselves in one call; padding left 0."""
    b, hkv, gt, d = q.shape
    t = keys.shape[2]
    g = gt // t
    qv = q.view(b, hkv, g, t, d)
    out = q.new_zeros(b, hkv, g, t, d)
    for i, n in enumerate(meta.prompt_lens):
        o = F.scaled_dot_product_attention(qv[i, :, :, :n].reshape(hkv * g, n, d), keys[i, :, :n], vals[i, :, :n],
                                           is_causal=True, enable_gqa=g > 1)
        out[i, :, :, :n] = o.view(hkv, g, n, d)
    return out.reshape(b, hkv * g, t, d)


def attend_latent_rows(attend, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, meta,
                       *args) -> torch.Tensor:
    """MLA's `attend` (mla.attend_absorbed or attend_expanded: q_nope, q_pe (B, T, nh, .), latent
    (B, S, W), bias (B, 1, T, S), *args -> (B, T, nh, v)) one token at a time over its visible latents."""
    b, t = q_nope.shape[:2]
    rows = []
    for i, row in enumerate(visible(meta)):
        toks = []
        for j, idx in enumerate(row):
            lat = latent[i:i + 1, idx]
            bias = lat.new_zeros(1, 1, 1, lat.shape[1])
            toks.append(attend(q_nope[i:i + 1, j:j + 1], q_pe[i:i + 1, j:j + 1], lat, bias, *args))
        rows.append(torch.cat(toks, 1))
    return torch.cat(rows, 0)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """llama.RMSNorm's arithmetic (given `residual`, first x + residual in x's dtype, returned as the new
    residual beside the normed rows; float32 statistics, the normed row in x's dtype times the weight)
    with one program a row, the whole row in one block: the same bits for a row whatever the rows
    beside it, and one kernel for the add and the norm."""
    d = x.shape[-1]
    xr = x.reshape(-1, d).contiguous()
    res = residual.reshape(-1, d).contiguous() if residual is not None else xr
    summed = torch.empty_like(xr) if residual is not None else xr
    out = torch.empty(xr.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if xr.shape[0]:
        # launched dependent on the kernel before (its weight read while that one finishes), and letting
        # the next kernel (a GEMV reading its weights before it waits) start at once
        gdc = dependent_launch(x)
        rms_norm_kernel[(xr.shape[0],)](xr, res, summed, weight, out, d, eps, BLOCK=triton.next_power_of_2(d),
                                        ADD=residual is not None, GDC=gdc, **({"launch_pdl": True} if gdc else {}))
    out = out.view(*x.shape[:-1], d)
    return out if residual is None else (out, summed.view(x.shape))


def chained_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """`rms_norm` as an op torch.compile keeps whole (llama.RMSNorm's path for a decode or verify step's
    few rows on the GPU: its norms as one kernel each, chained by dependent launch with the GEMVs around them)."""
    out, summed = torch.ops.eaglet.rms_norm(x, weight, eps, residual)
    return out if residual is None else (out, summed)


if triton is not None:
    @torch.library.custom_op("eaglet::rms_norm", mutates_args=())
    def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return rms_norm(x, weight, eps), x.new_empty(0)
        return rms_norm(x, weight, eps, residual)

    @_rms_norm_op.register_fake
    def _(x, weight, eps, residual):
        out = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))
        return out, (x.new_empty(0) if residual is None else torch.empty_like(x))


if triton is not None:
    @triton.jit
    def rms_norm_kernel(X, R, S, W, OUT, D, eps, BLOCK: tl.constexpr, ADD: tl.constexpr, GDC: tl.constexpr = False):
        r = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        m = c < D
        w = tl.load(W + c, mask=m, other=0.0)
        if GDC:  # launched dependent: let the next kernel start, then wait for X (and R) to be complete
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        x = tl.load(X + r * D + c, mask=m, other=0.0)
        if ADD:  # the residual stream: x + residual, rounded to x's dtype as torch's add rounds it
            x = (x.to(tl.float32) + tl.load(R + r * D + c, mask=m, other=0.0).to(tl.float32)).to(x.dtype)
            tl.store(S + r * D + c, x, mask=m)
        xf = x.to(tl.float32)
        normed = (xf * tl.rsqrt(tl.sum(xf * xf, 0) / D + eps)).to(x.dtype)
        tl.store(OUT + r * D + c, (w.to(tl.float32) * normed.to(tl.float32)).to(OUT.dtype.element_ty), mask=m)
