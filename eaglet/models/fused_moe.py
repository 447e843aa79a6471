"""Routed experts for a few tokens (decode, a verify tree: 1 to 64 tokens) as two Triton kernels that
read each touched expert's weights once per forward, with static shapes and no host sync (what the
CUDA graphs of decode and verify capture).

The (token, slot) pairs are sorted by expert on the device; a pair that heads its expert's run of
pairs owns that expert, every other program returns at once. The owner streams the expert's
weight tiles once and applies them to its pairs in chunks of CHUNK pairs:

- `gate_up_kernel`: h = SiLU(x W_gate^T) * (x W_up^T) for each pair, (pairs, I);
- `down_kernel`: y = (h W_down^T) * routing weight for each pair, (pairs, H);

and each token's k rows are summed in slot order. A token's result depends on its own routing
only: the same tiles and the same reduction order whatever the other tokens in the call, and one
tile configuration per layer shape (`Tiles`, chosen by `eaglet bench-moe --tune` and kept in
moe_tiles.json), whatever the token count. Dot products in the weights' dtype with float32
accumulation, as a matmul. Under TRITON_INTERPRET=1 (the CPU tests) it runs on any device.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .cache_attention import INTERPRET

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without Triton
    triton = None

CHUNK = 16  # pairs an owner applies a weight tile to at once (tl.dot's smallest tile)
MAX_TOKENS = 64
TILES_FILE = Path(__file__).with_name("moe_tiles.json")


@dataclass(frozen=True)
class Tiles:
    """One layer shape's tiles: output columns and reduction step of each kernel, and its warps."""
    gate_cols: int = 32   # gate-up: columns of I per program
    gate_step: int = 128  # gate-up: the H step of its reduction
    gate_warps: int = 4
    down_cols: int = 32   # down: columns of H per program
    down_step: int = 128  # down: the I step of its reduction
    down_warps: int = 4
    stages: int = 3


def shape_key(experts: int, hidden: int, width: int, top_k: int) -> str:
    return f"E{experts}-H{hidden}-I{width}-k{top_k}"


def load_tiles(path: Path = TILES_FILE) -> dict[str, Tiles]:
    """The tuned tiles by shape key (moe_tiles.json: {"shapes": {key: {...fields}}})."""
    if not path.exists():
        return {}
    return {k: Tiles(**v) for k, v in json.loads(path.read_text())["shapes"].items()}


def save_tiles(tiles: dict[str, Tiles], note: dict, path: Path = TILES_FILE) -> None:
    data = {"note": note, "shapes": {k: asdict(v) for k, v in sorted(tiles.items())}}
    path.write_text(json.dumps(data, indent=1) + "\n")


TUNED = load_tiles()


def tiles_for(experts: int, hidden: int, width: int, top_k: int) -> Tiles:
    return TUNED.get(shape_key(experts, hidden, width, top_k), Tiles())


def usable(x: torch.Tensor, experts: torch.Tensor) -> bool:
    """Whether the kernels take this call (a model asks only where its Kernels.moe is on)."""
    return (triton is not None and (x.is_cuda or INTERPRET) and 1 <= x.shape[0] <= MAX_TOKENS
            and not torch.is_grad_enabled())


def sort_pairs(experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token, slot) pairs grouped by expert, in token order within: (order, experts, tokens) of them."""
    k = experts.shape[1]
    order = experts.reshape(-1).argsort(stable=True)
    return order, experts.reshape(-1)[order].to(torch.int32), (order // k).to(torch.int32)


def gate_up_act(x: torch.Tensor, gate_up: torch.Tensor, sorted_e: torch.Tensor, token: torch.Tensor,
                tiles: Tiles) -> torch.Tensor:
    """SiLU(x W_gate^T) * (x W_up^T) of each sorted pair's token and expert: (pairs, I), x's dtype."""
    pairs, h_dim, i_dim = sorted_e.shape[0], x.shape[1], gate_up.shape[1] // 2
    act = torch.empty(pairs, i_dim, dtype=x.dtype, device=x.device)
    gate_up_kernel[(pairs, triton.cdiv(i_dim, tiles.gate_cols))](
        x, gate_up, sorted_e, token, act, pairs, h_dim, i_dim,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), act.stride(0),
        BI=tiles.gate_cols, BH=tiles.gate_step, CHUNK=CHUNK, num_warps=tiles.gate_warps, num_stages=tiles.stages)
    return act


def down_weighted(act: torch.Tensor, down: torch.Tensor, sorted_e: torch.Tensor, w: torch.Tensor,
                  tiles: Tiles) -> torch.Tensor:
    """(act W_down^T) times each sorted pair's routing weight: (pairs, H) float32."""
    pairs, h_dim, i_dim = sorted_e.shape[0], down.shape[1], down.shape[2]
    y = torch.empty(pairs, h_dim, dtype=torch.float32, device=act.device)
    down_kernel[(pairs, triton.cdiv(h_dim, tiles.down_cols))](
        act, down, sorted_e, w, y, pairs, h_dim, i_dim,
        act.stride(0), down.stride(0), down.stride(1), y.stride(0),
        BHO=tiles.down_cols, BI=tiles.down_step, CHUNK=CHUNK, num_warps=tiles.down_warps, num_stages=tiles.stages)
    return y


def fused_moe(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
              down: torch.Tensor, tiles: Tiles | None = None) -> torch.Tensor:
    """x (N, H), experts and weights (N, k), gate_up (E, 2I, H), down (E, H, I) -> (N, H)."""
    n, k = experts.shape
    tiles = tiles or tiles_for(gate_up.shape[0], x.shape[1], down.shape[2], k)
    order, sorted_e, token = sort_pairs(experts)
    act = gate_up_act(x, gate_up, sorted_e, token, tiles)
    y = down_weighted(act, down, sorted_e, weights.reshape(-1)[order].float(), tiles)
    out = torch.empty_like(y).index_copy_(0, order, y).view(n, k, x.shape[1])  # back to (token, slot) order
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
            wg_ptr = gate_up + e.to(tl.int64) * sge + cols[:, None] * sgr
            wu_ptr = wg_ptr + I * sgr
            for c in range(0, length, CHUNK):
                rows = p + c + tl.arange(0, CHUNK)
                live = (c + tl.arange(0, CHUNK)) < length
                tok = tl.load(token + rows, mask=live, other=0)
                g = tl.zeros((CHUNK, BI), dtype=tl.float32)
                u = tl.zeros((CHUNK, BI), dtype=tl.float32)
                for h0 in range(0, H, BH):
                    hs = h0 + tl.arange(0, BH)
                    xt = tl.load(x + tok[:, None] * sx + hs[None, :], mask=live[:, None] & (hs[None, :] < H),
                                 other=0.0)
                    wmask = (cols[:, None] < I) & (hs[None, :] < H)
                    wg = tl.load(wg_ptr + hs[None, :], mask=wmask, other=0.0)
                    wu = tl.load(wu_ptr + hs[None, :], mask=wmask, other=0.0)
                    g += tl.dot(xt, tl.trans(wg))
                    u += tl.dot(xt, tl.trans(wu))
                out = g / (1.0 + tl.exp(-g)) * u
                tl.store(act + rows[:, None] * sa + cols[None, :], out.to(act.dtype.element_ty),
                         mask=live[:, None] & (cols[None, :] < I))

    @triton.jit
    def down_kernel(act, down, sorted_e, w, y, pairs, H, I,
                    sa, sde, sdr, sy, BHO: tl.constexpr, BI: tl.constexpr, CHUNK: tl.constexpr):
        p = tl.program_id(0)
        e, head, length = run_of(sorted_e, p, pairs)
        if head:
            cols = tl.program_id(1) * BHO + tl.arange(0, BHO)
            wd_ptr = down + e.to(tl.int64) * sde + cols[:, None] * sdr
            for c in range(0, length, CHUNK):
                rows = p + c + tl.arange(0, CHUNK)
                live = (c + tl.arange(0, CHUNK)) < length
                acc = tl.zeros((CHUNK, BHO), dtype=tl.float32)
                for i0 in range(0, I, BI):
                    js = i0 + tl.arange(0, BI)
                    at = tl.load(act + rows[:, None] * sa + js[None, :], mask=live[:, None] & (js[None, :] < I),
                                 other=0.0)
                    wd = tl.load(wd_ptr + js[None, :], mask=(cols[:, None] < H) & (js[None, :] < I), other=0.0)
                    acc += tl.dot(at, tl.trans(wd))
                scale = tl.load(w + rows, mask=live, other=0.0)
                tl.store(y + rows[:, None] * sy + cols[None, :], acc * scale[:, None],
                         mask=live[:, None] & (cols[None, :] < H))
