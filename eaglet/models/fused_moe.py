"""Routed experts for a few tokens (decode, a verify tree: 1 to 64 tokens) as two Triton kernels that
read each touched expert's weights once per forward, with static shapes and no host sync (what the
CUDA graphs of decode and verify capture).

One program per (token, slot) pair and tile of columns; the program of an expert's first pair owns
that expert, every other one returns at once. The owner finds the expert's pairs among the call's
(no sort, no extra kernel), streams the expert's weight tiles once and applies them to its pairs in
chunks of CHUNK pairs:

- `gate_up_kernel`: h = SiLU(x W_gate^T) * (x W_up^T) for each pair, (pairs, I);
- `down_kernel`: y = (h W_down^T) * routing weight for each pair, (pairs, H);

and `combine_kernel` sums each token's k rows in slot order. Shared experts (DeepSeek, Kimi-K2) whose
width is a multiple of I run as each token's extra pairs: their S / I chunks of I columns are always
chosen, with weight 1, after the routed slots (`shared`), read from the shared expert's own fused
weights; the two kernels a token's shared MLP would take (and their boundaries) are saved.

A token's result depends on its own routing only: the same tiles and the same reduction order
whatever the other tokens in the call, and one tile configuration per layer shape (`Tiles`, chosen
by `eaglet bench-moe --tune` and kept in moe_tiles.json), whatever the token count. Dot products in
the weights' dtype with float32 accumulation, as a matmul. Under TRITON_INTERPRET=1 (the CPU tests) it runs on any device.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .cache_attention import INTERPRET, dependent_launch

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
    gate_span: int = 0  # gate-up: columns a program covers, <= gate_cols (0: gate_cols); one that is
    down_span: int = 0  # not a power of two spreads a layer over more SMs without a narrower tile
    down_pre: int = 1  # down, in a one-token call: reduction steps (0-2) whose weights a program loads
    # before it waits on gate-up's results (under dependent launch they stream while gate-up finishes;
    # with more tokens the grid spans waves and the held tile costs more than it hides)

    def __post_init__(self):  # what the kernels assume: a wider span or more preloaded steps would skip work
        for which, span, cols in (("gate", self.gate_span, self.gate_cols), ("down", self.down_span, self.down_cols)):
            if span > cols:
                raise ValueError(f"{which}_span {span} exceeds {which}_cols {cols} (a program's tile)")
        if not 0 <= self.down_pre <= 2:
            raise ValueError(f"down_pre {self.down_pre}: 0, 1 or 2 (reduction steps read before the wait)")

    def spans(self) -> tuple[int, int]:
        return self.gate_span or self.gate_cols, self.down_span or self.down_cols


@dataclass(frozen=True)
class Int4:
    """An expert stack of signed 4-bit weights kept packed as compressed-tensors packs them (eight a
    int32, value j of a word in bits 4j..4j+3, stored with an offset of 8) with one scale per row
    and group of columns: weight = (value - 8) x scale, dequantized tile by tile inside the kernels
    (a quarter of bfloat16's bytes, plus the scales)."""
    packed: torch.Tensor  # (E, R, C / 8) int32
    scale: torch.Tensor  # (E, R, C / group)
    group: int = 32

    @property
    def shape(self) -> tuple[int, int, int]:
        e, r, words = self.packed.shape
        return e, r, words * 8

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The stack as `dtype` weights (E, R, C), each expert as the loader dequantizes it."""
        from ..weights.quant import unpack

        shape = torch.tensor(self.shape[1:])
        return torch.stack([unpack("expert", p, s, shape, 4, self.group) for p, s in zip(self.packed, self.scale)]).to(dtype)


@dataclass(frozen=True)
class Fp8Block:
    """An expert stack of float8 (e4m3) weights with one float32 scale per block of 128 x 128 (the
    format DeepSeek-V3 and Kimi-K2 ship: weight x weight_scale_inv), kept as it is and scaled tile
    by tile inside the kernels (half of bfloat16's bytes)."""
    weight: torch.Tensor  # (E, R, C) float8_e4m3fn
    scale: torch.Tensor  # (E, ceil(R / block), ceil(C / block)) float32
    block: int = 128

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.weight.shape)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The stack as `dtype` weights (E, R, C), each expert as the loader dequantizes it."""
        from ..weights.quant import fp8_block

        blocks = (self.block, self.block)
        return torch.stack([fp8_block("expert", w, s, blocks) for w, s in zip(self.weight, self.scale)]).to(dtype)


Stack = torch.Tensor | Int4 | Fp8Block
PLAIN, INT4, FP8 = 0, 4, 8  # the kernels' QUANT: how a weight tile is read


def stack_args(w: Stack) -> tuple:
    """A stack's kernel arguments: weights, scales, their expert and row strides, QUANT, GROUP."""
    if isinstance(w, Int4):
        return (w.packed, w.scale, w.packed.stride(0), w.packed.stride(1), w.scale.stride(0), w.scale.stride(1),
                INT4, w.group)
    if isinstance(w, Fp8Block):
        return (w.weight, w.scale, w.weight.stride(0), w.weight.stride(1), w.scale.stride(0), w.scale.stride(1),
                FP8, w.block)
    return w, w, w.stride(0), w.stride(1), 0, 0, PLAIN, 1


def quant_name(w: Stack) -> str:
    return "int4" if isinstance(w, Int4) else "fp8" if isinstance(w, Fp8Block) else "bf16"


def shape_key(experts: int, hidden: int, width: int, top_k: int, quant: str = "bf16") -> str:
    return f"E{experts}-H{hidden}-I{width}-k{top_k}" + ("" if quant == "bf16" else f"-{quant}")


def load_tiles(path: Path = TILES_FILE) -> dict[str, Tiles]:
    """The tuned tiles by shape key (moe_tiles.json: {"shapes": {key: {...fields}}})."""
    if not path.exists():
        return {}
    return {k: Tiles(**v) for k, v in json.loads(path.read_text())["shapes"].items()}


def save_tiles(tiles: dict[str, Tiles], note: dict, path: Path = TILES_FILE) -> None:
    data = {"note": note, "shapes": {k: asdict(v) for k, v in sorted(tiles.items())}}
    path.write_text(json.dumps(data, indent=1) + "\n")


TUNED = load_tiles()


def tiles_for(experts: int, hidden: int, width: int, top_k: int, quant: str = "bf16") -> Tiles:
    return TUNED.get(shape_key(experts, hidden, width, top_k, quant), Tiles())


def usable(x: torch.Tensor) -> bool:
    """Whether the kernels take this call (a model asks only where its Kernels.moe is on)."""
    return (triton is not None and (x.is_cuda or INTERPRET) and 1 <= x.shape[0] <= MAX_TOKENS
            and not torch.is_grad_enabled())


def shared_chunks(shared: tuple[torch.Tensor, torch.Tensor] | None, i_dim: int) -> int:
    """How many chunks of I columns the shared experts' weights (gate_up (2S, H), down (H, S)) make: S / I."""
    return 0 if shared is None else shared[1].shape[1] // i_dim


def foldable(gate_up: Stack, shared_gate_up: torch.Tensor, shared_down: torch.Tensor) -> bool:
    """Whether the shared experts (fused gate-up (2S, H), down (H, S)) can run as extra pairs of the
    kernels: plain weights of the routed stack's dtype, rows of unit stride, S a multiple of I."""
    return (isinstance(gate_up, torch.Tensor) and gate_up.dtype == shared_gate_up.dtype == shared_down.dtype
            and shared_gate_up.stride(1) == 1 and shared_down.stride(1) == 1
            and shared_down.shape[1] % (gate_up.shape[1] // 2) == 0)


def gate_up_act(x: torch.Tensor, gate_up: Stack, experts: torch.Tensor, tiles: Tiles,
                counts: tuple[torch.Tensor, torch.Tensor] | None = None,
                shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """SiLU(x W_gate^T) * (x W_up^T) of each (token, slot) pair's token and expert: (N (k + X), I), x's
    dtype, a token's X shared chunks after its k routed slots. With `counts` (touched, forwards), adds
    the call's distinct routed experts and one forward to them."""
    n, k = experts.shape
    h_dim, i_dim = x.shape[1], gate_up.shape[1] // 2
    extra = shared_chunks(shared, i_dim)
    kx = k + extra
    act = torch.empty(n * kx, i_dim, dtype=x.dtype, device=x.device)
    touched, forwards = counts if counts is not None else (experts, experts)
    w, ws, swe, swr, sse, ssr, quant, group = stack_args(gate_up)
    w2 = w if shared is None else shared[0]  # chunk j: gate rows j I .. (j + 1) I - 1, up rows S after them
    span = tiles.spans()[0]
    gate_up_kernel[(n * kx, triton.cdiv(i_dim, span))](
        x, w, ws, experts, act, touched, forwards, n * kx, k, h_dim, i_dim,
        x.stride(0), swe, swr, sse, ssr, act.stride(0),
        w2, i_dim * w2.stride(0), w2.stride(0), extra * i_dim, gate_up.shape[0], QUANT=quant, GROUP=group,
        PAIRS=triton.next_power_of_2(n * kx), BI=tiles.gate_cols, SPAN=span, BH=tiles.gate_step, CHUNK=CHUNK,
        COUNT=counts is not None, SHARED=extra, GDC=dependent_launch(x), num_warps=tiles.gate_warps,
        num_stages=tiles.stages)
    return act


def down_weighted(act: torch.Tensor, down: Stack, experts: torch.Tensor, weights: torch.Tensor,
                  tiles: Tiles, shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """(act W_down^T) times each pair's routing weight (float32, (N, k); a shared chunk's: 1), with the
    shared experts' down weight (H, S) for their chunks: (N (k + X), H) float32."""
    n, k = experts.shape
    h_dim, i_dim = down.shape[1], down.shape[2]
    extra = shared_chunks(shared, i_dim)
    pairs = n * (k + extra)
    y = torch.empty(pairs, h_dim, dtype=torch.float32, device=act.device)
    gdc = dependent_launch(act)
    w, ws, swe, swr, sse, ssr, quant, group = stack_args(down)
    w2 = w if shared is None else shared[1]  # chunk j: columns j I .. (j + 1) I - 1
    span = tiles.spans()[1]
    down_kernel[(pairs, triton.cdiv(h_dim, span))](
        act, w, ws, experts, weights, y, pairs, k, h_dim, i_dim,
        act.stride(0), swe, swr, sse, ssr, y.stride(0), w2, i_dim * w2.stride(1), w2.stride(0), down.shape[0],
        QUANT=quant, GROUP=group,
        PAIRS=triton.next_power_of_2(pairs), BHO=tiles.down_cols, SPAN=span, BI=tiles.down_step, CHUNK=CHUNK,
        PRE=tiles.down_pre if n == 1 else 0, SHARED=extra, GDC=gdc, num_warps=tiles.down_warps,
        num_stages=tiles.stages, **({"launch_pdl": True} if gdc else {}))
    return y


def fused_moe(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up: Stack,
              down: Stack, tiles: Tiles | None = None,
              counts: tuple[torch.Tensor, torch.Tensor] | None = None,
              add: torch.Tensor | None = None,
              shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x (N, H), experts and weights (N, k), gate_up (E, 2I, H), down (E, H, I), each bfloat16 or
    quantized (Int4, Fp8Block) -> (N, H); `counts`:
    a layer's (touched, forwards) counters, advanced by the call; `add` (N, H): added to the sum
    (the shared experts' output); or `shared`: the shared experts' fused gate-up (2S, H) and down
    (H, S) weights (`foldable`), run as each token's S / I extra pairs of weight 1."""
    n, k = experts.shape
    tiles = tiles or tiles_for(gate_up.shape[0], x.shape[1], down.shape[2], k, quant_name(gate_up))
    experts = experts.contiguous()
    act = gate_up_act(x, gate_up, experts, tiles, counts, shared)
    y = down_weighted(act, down, experts, weights.float().contiguous(), tiles, shared)
    k += shared_chunks(shared, down.shape[2])
    out = torch.empty_like(x)
    block = 1024
    gdc = dependent_launch(x)
    combine_kernel[(n, triton.cdiv(x.shape[1], block))](
        y, out, out if add is None else add.contiguous(), x.shape[1], K=k, BLOCK=block, ADD=add is not None,
        GDC=gdc, **({"launch_pdl": True} if gdc else {}))
    return out


if triton is not None:
    @triton.jit
    def expert_of(experts, js, pairs, K, E, SHARED: tl.constexpr):
        """The experts of pairs js: a routed slot's from `experts` (N, K), a shared chunk's E + its
        index (a token's K routed slots first, then its SHARED chunks); -1 past the call's pairs."""
        if SHARED == 0:
            return tl.load(experts + js, mask=js < pairs, other=-1)
        else:
            tok, slot = js // (K + SHARED), js % (K + SHARED)
            routed = tl.load(experts + tok * K + slot, mask=(js < pairs) & (slot < K), other=-1)
            return tl.where(js < pairs, tl.where(slot < K, routed, E + slot - K), -1)

    @triton.jit
    def run_of(experts, p, pairs, K, E, PAIRS: tl.constexpr, CHUNK: tl.constexpr, SHARED: tl.constexpr):
        """Pair p's expert, whether p is its expert's first pair, how many pairs it has, and a
        (CHUNK, PAIRS) one-hot selector: row r of chunk c picks the expert's (c + r)-th pair
        (`member`). No sort: every program reads the <= PAIRS experts of the call."""
        js = tl.arange(0, PAIRS)
        all_e = expert_of(experts, js, pairs, K, E, SHARED)
        if SHARED == 0:
            e = tl.load(experts + p)
        else:
            e = tl.sum(tl.where(js == p, all_e, 0), 0)
        same = all_e == e
        head = tl.sum((same & (js < p)).to(tl.int32), 0) == 0
        rank = tl.cumsum(same.to(tl.int32), 0) - 1  # among the expert's pairs, in (token, slot) order
        return e, head, tl.sum(same.to(tl.int32), 0), same, rank

    @triton.jit
    def member(same, rank, c, PAIRS: tl.constexpr, CHUNK: tl.constexpr):
        """The pair indices of chunk c of the expert's pairs (CHUNK,), and which of them exist."""
        r = c + tl.arange(0, CHUNK)
        pick = same[None, :] & (rank[None, :] == r[:, None])
        idx = tl.sum(tl.where(pick, tl.arange(0, PAIRS)[None, :], 0), 1)
        return idx, tl.sum(pick.to(tl.int32), 1) > 0

    @triton.jit
    def group_scales(ws, rowoff, rmask, c0, C, R: tl.constexpr, BC: tl.constexpr, GROUP: tl.constexpr):
        """The scales of a tile's columns c0 .. c0 + BC - 1 (of C), one per GROUP columns, each row's at
        ws + rowoff: loaded once per group and spread over its columns in registers (R, BC) float32."""
        if BC >= GROUP:
            gi = c0 // GROUP + tl.arange(0, BC // GROUP)
            s = tl.load(ws + rowoff[:, None] + gi[None, :], mask=rmask[:, None] & (gi * GROUP < C)[None, :], other=0.0)
            return tl.reshape(tl.broadcast_to(s.to(tl.float32)[:, :, None], (R, BC // GROUP, GROUP)), (R, BC))
        else:  # the tile inside one group
            s = tl.load(ws + rowoff + c0 // GROUP, mask=rmask, other=0.0)
            return tl.broadcast_to(s.to(tl.float32)[:, None], (R, BC))

    @triton.jit
    def weight_tile(w, ws, e, rows, rmask, c0, C, swe, swr, sse, ssr, R: tl.constexpr, BC: tl.constexpr,
                    QUANT: tl.constexpr, GROUP: tl.constexpr):
        """Rows `rows` (R, `rmask`: which exist) x columns c0 .. c0 + BC - 1 (of C) of expert e's weights,
        unpacked and scaled in float32 where quantized (BC and GROUP powers of two). INT4: each packed
        word loaded once and its eight values shifted out in registers, a scale per row and GROUP
        columns; FP8: a scale per GROUP x GROUP block. Words and scales load once, not once per weight:
        a load per weight spills the tile's registers (3.7 KB of stack a thread for INT4's gate-up at
        Kimi-K2's tiles, cuobjdump --dump-resource-usage on the sm_90 cubin)."""
        if QUANT == 4:
            wi = c0 // 8 + tl.arange(0, BC // 8)
            word = tl.load(w + e * swe + rows[:, None] * swr + wi[None, :], mask=rmask[:, None] & (wi * 8 < C)[None, :],
                           other=0)  # (R, BC / 8)
            q = (word[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 15
            q = tl.reshape(q, (R, BC)) - 8
            return q.to(tl.float32) * group_scales(ws, e * sse + rows * ssr, rmask, c0, C, R, BC, GROUP)
        elif QUANT == 8:
            cols = c0 + tl.arange(0, BC)
            q = tl.load(w + e * swe + rows[:, None] * swr + cols[None, :], mask=rmask[:, None] & (cols < C)[None, :],
                        other=0.0)
            return q.to(tl.float32) * group_scales(ws, e * sse + (rows // GROUP) * ssr, rmask, c0, C, R, BC, GROUP)
        else:
            cols = c0 + tl.arange(0, BC)
            return tl.load(w + e * swe + rows[:, None] * swr + cols[None, :], mask=rmask[:, None] & (cols < C)[None, :],
                           other=0.0)

    @triton.jit
    def gate_up_kernel(x, w, ws, experts, act, touched, forwards, pairs, K, H, I, sx, swe, swr, sse, ssr, sa,
                       w2, swe2, swr2, up2, E, QUANT: tl.constexpr, GROUP: tl.constexpr,
                       PAIRS: tl.constexpr, BI: tl.constexpr, SPAN: tl.constexpr, BH: tl.constexpr,
                       CHUNK: tl.constexpr, COUNT: tl.constexpr, SHARED: tl.constexpr, GDC: tl.constexpr):
        if GDC:  # the down kernel may launch now; it waits for these results before reading them
            tl.extra.cuda.gdc_launch_dependents()
        p = tl.program_id(0)
        e, head, length, same, rank = run_of(experts, p, pairs, K, E, PAIRS, CHUNK, SHARED)
        if COUNT and tl.program_id(1) == 0:  # one count a routed expert (its owner), one forward a call
            if head and (SHARED == 0 or e < E):
                tl.atomic_add(touched, 1)
            if p == 0:
                tl.atomic_add(forwards, 1)
        if head:
            e = e.to(tl.int64)
            wb, se, sr, up = w, swe, swr, I
            if SHARED > 0:  # a shared chunk: the shared experts' weights, gate rows e I.., up rows up2 after
                own = e >= E
                wb, se, sr = tl.where(own, w2, w), tl.where(own, swe2, swe), tl.where(own, swr2, swr)
                up = tl.where(own, up2, I)
                e = tl.where(own, e - E, e)
            cols = tl.program_id(1) * SPAN + tl.arange(0, BI)
            cm = (tl.arange(0, BI) < SPAN) & (cols < I)  # masked columns cost no bytes
            for c in range(0, length, CHUNK):
                rows, live = member(same, rank, c, PAIRS, CHUNK)
                tok = rows // (K + SHARED)
                g = tl.zeros((CHUNK, BI), dtype=tl.float32)
                u = tl.zeros((CHUNK, BI), dtype=tl.float32)
                for h0 in range(0, H, BH):
                    hs = h0 + tl.arange(0, BH)
                    xt = tl.load(x + tok[:, None] * sx + hs[None, :], mask=live[:, None] & (hs[None, :] < H),
                                 other=0.0)
                    wg = weight_tile(wb, ws, e, cols, cm, h0, H, se, sr, sse, ssr, BI, BH, QUANT, GROUP)
                    wu = weight_tile(wb, ws, e, cols + up, cm, h0, H, se, sr, sse, ssr, BI, BH, QUANT, GROUP)
                    wg, wu = wg.to(xt.dtype), wu.to(xt.dtype)
                    g += tl.dot(xt, tl.trans(wg))
                    u += tl.dot(xt, tl.trans(wu))
                out = g / (1.0 + tl.exp(-g)) * u
                tl.store(act + rows[:, None] * sa + cols[None, :], out.to(act.dtype.element_ty),
                         mask=live[:, None] & cm[None, :])

    @triton.jit
    def down_step(acc, act, rows, live, sa, i0, I, wd, BI: tl.constexpr):
        """acc + act[rows, i0:i0+BI] wd^T: one step of the down reduction."""
        js = i0 + tl.arange(0, BI)
        at = tl.load(act + rows[:, None] * sa + js[None, :], mask=live[:, None] & (js[None, :] < I), other=0.0)
        return acc + tl.dot(at, tl.trans(wd.to(at.dtype)))

    @triton.jit
    def down_kernel(act, w, ws, experts, wt, y, pairs, K, H, I, sa, swe, swr, sse, ssr, sy, w2, swe2, swr2, E,
                    QUANT: tl.constexpr, GROUP: tl.constexpr,
                    PAIRS: tl.constexpr, BHO: tl.constexpr, SPAN: tl.constexpr, BI: tl.constexpr,
                    CHUNK: tl.constexpr, PRE: tl.constexpr, SHARED: tl.constexpr, GDC: tl.constexpr):
        if GDC:
            tl.extra.cuda.gdc_launch_dependents()
        p = tl.program_id(0)
        e, head, length, same, rank = run_of(experts, p, pairs, K, E, PAIRS, CHUNK, SHARED)
        if head:
            e = e.to(tl.int64)
            wb, se, sr = w, swe, swr
            if SHARED > 0:  # a shared chunk: columns e I .. of the shared experts' down weight
                own = e >= E
                wb, se, sr = tl.where(own, w2, w), tl.where(own, swe2, swe), tl.where(own, swr2, swr)
                e = tl.where(own, e - E, e)
            cols = tl.program_id(1) * SPAN + tl.arange(0, BHO)
            cm = (tl.arange(0, BHO) < SPAN) & (cols < H)
            if PRE >= 1:  # the first steps' weights do not depend on gate-up: read them before waiting
                w0 = weight_tile(wb, ws, e, cols, cm, 0, I, se, sr, sse, ssr, BHO, BI, QUANT, GROUP)
            if PRE >= 2:
                w1 = weight_tile(wb, ws, e, cols, cm, BI, I, se, sr, sse, ssr, BHO, BI, QUANT, GROUP)
            if GDC:  # the gate-up kernel's act, complete and visible
                tl.extra.cuda.gdc_wait()
            for c in range(0, length, CHUNK):
                rows, live = member(same, rank, c, PAIRS, CHUNK)
                acc = tl.zeros((CHUNK, BHO), dtype=tl.float32)
                if PRE >= 1:  # the same steps in the same order as the loop's
                    acc = down_step(acc, act, rows, live, sa, 0, I, w0, BI)
                if PRE >= 2:
                    acc = down_step(acc, act, rows, live, sa, BI, I, w1, BI)
                for i0 in range(PRE * BI, I, BI):
                    wd = weight_tile(wb, ws, e, cols, cm, i0, I, se, sr, sse, ssr, BHO, BI, QUANT, GROUP)
                    acc = down_step(acc, act, rows, live, sa, i0, I, wd, BI)
                if SHARED == 0:
                    scale = tl.load(wt + rows, mask=live, other=0.0)
                else:  # a routed slot's routing weight; a shared chunk's 1
                    slot = rows % (K + SHARED)
                    scale = tl.load(wt + (rows // (K + SHARED)) * K + slot, mask=live & (slot < K), other=1.0)
                tl.store(y + rows[:, None] * sy + cols[None, :], acc * scale[:, None],
                         mask=live[:, None] & cm[None, :])

    @triton.jit
    def combine_kernel(y, out, add, H, K: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr, GDC: tl.constexpr):
        """out[t] = sum over slots of y[t k + j], in slot order, in float32 (plus add[t] where given),
        then x's dtype."""
        if GDC:  # the next kernel (the next layer's norm, launched dependent) may start now
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        t = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        acc = tl.load(y + t * K * H + cols, mask=cols < H, other=0.0)
        for j in tl.static_range(1, K):
            acc += tl.load(y + (t * K + j) * H + cols, mask=cols < H, other=0.0)
        if ADD:
            acc += tl.load(add + t * H + cols, mask=cols < H, other=0.0).to(tl.float32)
        tl.store(out + t * H + cols, acc.to(out.dtype.element_ty), mask=cols < H)
