"""Routed experts for a few tokens (decode, a verify tree: 1 to 64 tokens) as two Triton kernels that
read each touched expert's weights once per forward, with static shapes and no host sync (what the
CUDA graphs of decode and verify capture).

The (token, slot) pairs are sorted by expert on the device; a pair that heads its expert's run of
pairs owns that expert, every other program returns at once. The owner streams the expert's
weight tiles once and applies them to its pairs in chunks of CHUNK tokens:

- `gate_up_kernel`: h = SiLU(x W_gate^T) * (x W_up^T) for each pair, (pairs, I);
- `down_kernel`: y = (h W_down^T) * routing weight for each pair, (pairs, H);

and each token's k rows are summed in slot order. A token's result depends on its own routing
only: the same tiles and the same reduction order whatever the other tokens in the call. Sums run
in float32. Off by default (Kernels.moe) until measured on the GPU; under TRITON_INTERPRET=1 (the CPU
tests) it runs on any device.
"""
from __future__ import annotations

import torch

from .cache_attention import INTERPRET

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without Triton
    triton = None

CHUNK = 16  # pairs an owner applies a weight tile to at once (tl.dot's smallest tile)
MAX_TOKENS = 64


def usable(x: torch.Tensor, experts: torch.Tensor) -> bool:
    """Whether the kernels take this call (a model asks only where its Kernels.moe is on)."""
    return (triton is not None and (x.is_cuda or INTERPRET) and 1 <= x.shape[0] <= MAX_TOKENS
            and not torch.is_grad_enabled())


def fused_moe(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
              down: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x (N, H), experts and weights (N, k), gate_up (E, 2I, H), down (E, H, I) -> (N, H)."""
    n, k = experts.shape
    h_dim, i_dim = x.shape[1], down.shape[2]
    pairs = n * k
    order = experts.reshape(-1).argsort(stable=True)  # pairs grouped by expert, in token order within
    sorted_e = experts.reshape(-1)[order].to(torch.int32)
    token = (order // k).to(torch.int32)
    w = weights.reshape(-1)[order].float()
    act = torch.empty(pairs, i_dim, dtype=torch.float32, device=x.device)
    gate_up_kernel[(pairs, triton.cdiv(i_dim, block))](
        x, gate_up, sorted_e, token, act, pairs, h_dim, i_dim,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), act.stride(0),
        BI=block, BH=block, CHUNK=CHUNK)
    y = torch.empty(pairs, h_dim, dtype=torch.float32, device=x.device)
    down_kernel[(pairs, triton.cdiv(h_dim, block))](
        act, down, sorted_e, w, y, pairs, h_dim, i_dim,
        act.stride(0), down.stride(0), down.stride(1), y.stride(0),
        BHO=block, BI=block, CHUNK=CHUNK)
    out = torch.empty_like(y).index_copy_(0, order, y).view(n, k, h_dim)  # back to (token, slot) order
    acc = out[:, 0]
    for j in range(1, k):  # slot by slot: one reduction order for every token, whatever the count
        acc = acc + out[:, j]
    return acc.to(x.dtype)


if triton is not None:
    @triton.jit
    def run_of(sorted_e, p, pairs):
        """(expert, whether pair p heads its run, the run's length) of the sorted pairs."""
        e = tl.load(sorted_e + p)
        prev = tl.load(sorted_e + tl.maximum(p - 1, 0))
        head = (p == 0) | (prev != e)
        offs = p + tl.arange(0, 64)
        same = (offs < pairs) & (tl.load(sorted_e + offs, mask=offs < pairs, other=-1) == e)
        return e, head, tl.sum(same.to(tl.int32), 0)  # a run holds at most one pair a token: <= 64

    @triton.jit
    def gate_up_kernel(x, gate_up, sorted_e, token, act, pairs, H, I,
                       sx, sge, sgr, sa, BI: tl.constexpr, BH: tl.constexpr, CHUNK: tl.constexpr):
        p = tl.program_id(0)
        e, head, length = run_of(sorted_e, p, pairs)
        if head:
            cols = tl.program_id(1) * BI + tl.arange(0, BI)
            for c in range(0, length, CHUNK):
                rows = p + c + tl.arange(0, CHUNK)
                live = (c + tl.arange(0, CHUNK)) < length
                tok = tl.load(token + rows, mask=live, other=0)
                g = tl.zeros((CHUNK, BI), dtype=tl.float32)
                u = tl.zeros((CHUNK, BI), dtype=tl.float32)
                for h0 in range(0, H, BH):
                    hs = h0 + tl.arange(0, BH)
                    xt = tl.load(x + tok[:, None] * sx + hs[None, :], mask=live[:, None] & (hs[None, :] < H),
                                 other=0.0).to(tl.float32)
                    wmask = (cols[:, None] < I) & (hs[None, :] < H)
                    wg = tl.load(gate_up + e * sge + cols[:, None] * sgr + hs[None, :], mask=wmask, other=0.0)
                    wu = tl.load(gate_up + e * sge + (cols[:, None] + I) * sgr + hs[None, :], mask=wmask, other=0.0)
                    g += tl.dot(xt, tl.trans(wg.to(tl.float32)))
                    u += tl.dot(xt, tl.trans(wu.to(tl.float32)))
                out = g / (1.0 + tl.exp(-g)) * u
                tl.store(act + rows[:, None] * sa + cols[None, :], out, mask=live[:, None] & (cols[None, :] < I))

    @triton.jit
    def down_kernel(act, down, sorted_e, w, y, pairs, H, I,
                    sa, sde, sdr, sy, BHO: tl.constexpr, BI: tl.constexpr, CHUNK: tl.constexpr):
        p = tl.program_id(0)
        e, head, length = run_of(sorted_e, p, pairs)
        if head:
            cols = tl.program_id(1) * BHO + tl.arange(0, BHO)
            for c in range(0, length, CHUNK):
                rows = p + c + tl.arange(0, CHUNK)
                live = (c + tl.arange(0, CHUNK)) < length
                acc = tl.zeros((CHUNK, BHO), dtype=tl.float32)
                for i0 in range(0, I, BI):
                    js = i0 + tl.arange(0, BI)
                    at = tl.load(act + rows[:, None] * sa + js[None, :], mask=live[:, None] & (js[None, :] < I),
                                 other=0.0)
                    wd = tl.load(down + e * sde + cols[:, None] * sdr + js[None, :],
                                 mask=(cols[:, None] < H) & (js[None, :] < I), other=0.0)
                    acc += tl.dot(at, tl.trans(wd.to(tl.float32)))
                scale = tl.load(w + rows, mask=live, other=0.0)
                tl.store(y + rows[:, None] * sy + cols[None, :], acc * scale[:, None],
                         mask=live[:, None] & (cols[None, :] < H))
