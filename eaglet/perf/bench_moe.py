"""`eaglet bench-moe`: one MoE layer's routed experts at a real shape, random weights, for 1 to 64
tokens, each path against the touched-bytes floor: the distinct experts the tokens route to, times
an expert's bytes, over the measured copy bandwidth.

Paths: `fused` (models/fused_moe.py, the tiles of moe_tiles.json), `grouped` (torch._grouped_mm
over the pairs sorted by expert), `gathered` (each token's k experts' weights gathered: what a GPU
without the kernels runs), `loop` (expert by expert with a host sync, as transformers' layer).
Each is timed as CUDA-graph replays (the loop eagerly), medians over repeats, and run over enough
copies of the layer's weights that the L2 cache holds none of them. Routing is uniform: each token's
k experts drawn at random.

`--tune` sweeps the fused kernels' tiles and keeps per shape the one configuration with the least
summed time over floor across the token counts (one configuration for every count, so a token's
result does not depend on how many tokens share its call), written to moe_tiles.json with the
sweep in the record.
"""
from __future__ import annotations

import dataclasses
import gc
import itertools
import math
from dataclasses import asdict, replace

import torch

from ..errors import InvalidInput
from ..models import fused_moe
from ..models.fused_moe import Fp8Block, Int4, Tiles
from ..models.moe import by_expert, gathered, grouped
from . import curves
from .shapes import SHAPES, copy_bandwidth

PATHS = ("fused", "grouped", "gathered", "loop")
TOKENS = (1, 2, 4, 8, 16, 32, 64)
L2_SAFE = 1 << 30  # bytes a replay reads at one token at least, copies of the layer included
GATHER_LIMIT = 8 << 30  # the gathered path materializes every pair's weights: skipped above this
SWEEP_COLS, SWEEP_STEPS, SWEEP_WARPS, SWEEP_STAGES = (16, 32, 64), (64, 128, 256), (4, 8), (2, 3, 4, 5)


def add_parser(sub) -> None:
    p = sub.add_parser("bench-moe", help="one MoE layer's routed experts against the touched-bytes floor",
                       description="Time the routed experts of one MoE layer of a real shape (random weights, "
                                   "uniform routing) for 1 to 64 tokens on each path (fused Triton kernels, "
                                   "torch._grouped_mm, gathered weights, the expert loop) against the floor: the "
                                   "distinct experts touched x an expert's bytes / the measured copy bandwidth. "
                                   "--tune sweeps the fused kernels' tiles and writes the best per shape.")
    moe_shapes = [n for n, c in SHAPES.items() if c.moe is not None]
    p.add_argument("--shape", nargs="+", default=["kimi-k2", "qwen3-30b-a3b"], metavar="NAME",
                   help=f"MoE shapes: {', '.join(moe_shapes)}")
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS), help="token counts, 1 to 64")
    p.add_argument("--paths", nargs="+", default=["fused", "grouped", "gathered"], choices=PATHS)
    p.add_argument("--quant", nargs="+", default=["bf16"], choices=["bf16", "int4", "fp8"],
                   help="expert weights: bfloat16, INT4 packs (group 32, bfloat16 scales) and/or FP8 with a "
                        "scale per 128 x 128 block, read as stored by the fused kernels, each against its own floor")
    p.add_argument("--tune", action="store_true", help="sweep the fused kernels' tiles; write the best per shape")
    p.add_argument("--tune-tokens", type=int, nargs="+", metavar="T",
                   help="the token counts --tune scores tiles on (default: every --tokens count)")
    p.add_argument("--tiles-out", default=str(fused_moe.TILES_FILE), help="where --tune writes the tiles")
    p.add_argument("--tiles", nargs="+", default=[], metavar="FIELD=N",
                   help="these tile fields instead of the tuned ones, e.g. gate_cols=32 (an A/B of one field; "
                        f"fields: {', '.join(f.name for f in dataclasses.fields(Tiles))})")
    p.add_argument("--repeats", type=int, default=15, help="timed repeats (median reported)")
    p.add_argument("--out", default="bench/results", help="directory for the JSON record")


def cmd_bench_moe(args) -> int:
    run_bench_moe(args)
    return 0


def tile_fields(items: list[str]) -> dict[str, int]:
    """--tiles FIELD=N ... as {field: N}; one error line for a field Tiles lacks, a value not a positive
    int (down_pre may be 0), or a block size or warp count not a power of two (Triton's blocks and
    warps must be); the fields' limits against each other are Tiles' own checks."""
    names, out = {f.name for f in dataclasses.fields(Tiles)}, {}
    for item in items:
        name, _, value = item.partition("=")
        if name not in names:
            raise InvalidInput(f"--tiles {item}: no tile field {name!r} (fields: {', '.join(sorted(names))})")
        least = 0 if name == "down_pre" else 1  # down_pre=0 turns it off
        if not value.isdigit() or int(value) < least:
            raise InvalidInput(f"--tiles {item}: the value must be an integer of at least {least}")
        n = out[name] = int(value)
        if name not in ("stages", "gate_span", "down_span", "down_pre") and n & (n - 1):
            raise InvalidInput(f"--tiles {item}: {name} must be a power of two")
    return out


def layer_dims(name: str) -> tuple[int, int, int, int]:
    """An MoE shape's layer: (experts, hidden, expert width, top-k)."""
    cfg = SHAPES[name]
    return cfg.moe.num_experts, cfg.hidden_size, cfg.moe.expert_size, cfg.moe.top_k


def layer_tiles(name: str, quant: str, items: list[str]) -> Tiles:
    """The tiles a run times for shape `name`: the tuned ones, with --tiles' fields instead; one error
    line for tiles the kernels cannot run (Tiles' own checks)."""
    try:
        return replace(fused_moe.tiles_for(*layer_dims(name), quant), **tile_fields(items))
    except ValueError as e:
        raise InvalidInput(f"--tiles: {e}") from None


def check_args(args) -> None:
    tile_fields(args.tiles)
    if args.tiles and args.tune:
        raise InvalidInput("--tiles with --tune: the sweep chooses every field")
    for name in args.shape:
        if name not in SHAPES or SHAPES[name].moe is None:
            raise InvalidInput(f"--shape {name}: not an MoE shape (choose from "
                               f"{', '.join(n for n, c in SHAPES.items() if c.moe is not None)})")
        for quant in args.quant:  # a span wider than its tile, with the shape's tuned tiles
            layer_tiles(name, quant, args.tiles)
    bad = [t for t in args.tokens if not 1 <= t <= fused_moe.MAX_TOKENS]
    if bad:
        raise InvalidInput(f"--tokens {bad[0]}: must be 1 to {fused_moe.MAX_TOKENS}")
    extra = [t for t in args.tune_tokens or () if t not in args.tokens]
    if extra:
        raise InvalidInput(f"--tune-tokens {extra[0]}: not among --tokens {' '.join(map(str, args.tokens))}")
    if not torch.cuda.is_available() or fused_moe.triton is None:
        raise InvalidInput("bench-moe needs a CUDA GPU with Triton")


def time_ms(fn, repeats: int, graph: bool = True) -> float:
    """Median milliseconds of one call: CUDA-graph replays after a warm-up (eager calls if not `graph`)."""
    fn()
    torch.cuda.synchronize()
    run = fn
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    run()
    return curves.time_ms(run, torch.device("cuda"), repeats)


def copies_that_fit(name: str, quant: str, layer_bytes: int, one_token: int, free: int | None) -> int:
    """Copies of a layer's experts a bench keeps: enough that a replay reads L2_SAFE bytes, as many as
    fit in 60% of the GPU's free memory (Kimi-K2's 34 GB layer: two on an H200, one on an H100; any
    number on the CPU, `free` None); one error line where one copy does not fit in 90% of it."""
    if free is not None and layer_bytes > 0.9 * free:
        raise InvalidInput(f"--shape {name}: one layer's experts ({layer_bytes / 1e9:.1f} GB as {quant}) do not fit "
                           f"this GPU's free memory ({free / 1e9:.1f} GB)")
    fit = 8 if free is None else int(0.6 * free // layer_bytes)
    return max(1, min(8, math.ceil(L2_SAFE / one_token), fit))


class Layer:
    """Copies of one MoE layer's expert stacks (random, bf16) and a uniform routing per token count."""

    def __init__(self, name: str, device: torch.device, tokens: list[int], quant: str = "bf16",
                 dtype: torch.dtype = torch.bfloat16):
        self.e, self.h, self.i, self.k = layer_dims(name)
        self.quant, self.dtype = quant, dtype
        gen = torch.Generator(device=device).manual_seed(0)
        make = {"int4": self.packed, "fp8": self.fp8}.get(quant, self.dense)
        one = [make(1, 2 * self.i, self.h, gen), make(1, self.h, self.i, gen)]
        # bytes as bfloat16 weights and scales: what the GPU reads (the CPU tests run float32)
        self.expert_bytes = sum(stored_bytes(w) for w in one)
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
        self.copies = copies_that_fit(name, quant, self.e * self.expert_bytes, self.k * self.expert_bytes, free)
        self.stacks = [(make(self.e, 2 * self.i, self.h, gen), make(self.e, self.h, self.i, gen))
                       for _ in range(self.copies)]
        self.inputs = {}
        for t in tokens:
            x = torch.randn(t, self.h, device=device, dtype=dtype, generator=gen)
            experts = torch.rand(t, self.e, device=device, generator=gen).topk(self.k, -1).indices
            weights = torch.rand(t, self.k, device=device, generator=gen).softmax(-1)
            self.inputs[t] = (x, experts, weights)

    def dense(self, e: int, rows: int, cols: int, gen) -> torch.Tensor:
        return torch.randn(e, rows, cols, device=gen.device, dtype=self.dtype, generator=gen).mul_(0.02)  # no second copy

    def packed(self, e: int, rows: int, cols: int, gen) -> Int4:
        words = torch.randint(-2**31, 2**31 - 1, (e, rows, cols // 8), device=gen.device, dtype=torch.int32,
                              generator=gen)
        return Int4(words, torch.full((e, rows, cols // 32), 0.005, device=gen.device, dtype=self.dtype))

    def fp8(self, e: int, rows: int, cols: int, gen) -> Fp8Block:
        w = torch.empty(e, rows, cols, device=gen.device, dtype=torch.float8_e4m3fn)
        for j in range(e):  # an expert at a time: float32 noise for a whole stack is 4x its FP8 bytes
            w[j] = torch.randn(rows, cols, device=gen.device, generator=gen) * 0.5
        return Fp8Block(w, torch.full((e, -(-rows // 128), -(-cols // 128)), 0.04, device=gen.device))

    def distinct(self, t: int) -> int:
        return self.inputs[t][1].unique().numel()  # sync: outside any timing

    def floor_ms(self, t: int, bandwidth: float) -> float:
        return self.distinct(t) * self.expert_bytes / bandwidth * 1e3

    def run(self, path: str, t: int, tiles: Tiles | None = None):
        """A callable that applies `path` to every copy; its time divided by copies is one layer's."""
        x, experts, weights = self.inputs[t]
        fn = {"fused": lambda *a: fused_moe.fused_moe(*a, tiles=tiles), "grouped": grouped,
              "gathered": gathered, "loop": by_expert}[path]

        def go():
            for gu, dn in self.stacks:
                fn(x, experts, weights, gu, dn)
        return go

    def kernel(self, which: str, t: int, tiles: Tiles):
        """One fused kernel alone over every copy (the sweep times gate-up and down apart)."""
        x, experts, weights = self.inputs[t]
        w = weights.float()
        act = torch.randn(experts.numel(), self.i, device=x.device, dtype=x.dtype)

        def go():
            for gu, dn in self.stacks:
                if which == "gate":
                    fused_moe.gate_up_act(x, gu, experts, tiles)
                else:
                    fused_moe.down_weighted(act, dn, experts, w, tiles)
        return go


def fits(timed, tokens: list[int]) -> dict | None:
    """{tokens: timed(tokens)}, or None where the tiles need more shared memory than the GPU has."""
    from triton.runtime.errors import OutOfResources
    try:
        return {t: timed(t) for t in tokens}
    except OutOfResources:
        return None


def stored_bytes(w) -> int:
    """One expert's bytes as the GPU stores them (weights and scales; bfloat16 scales for INT4)."""
    if isinstance(w, Int4):
        return w.packed[0].numel() * 4 + w.scale[0].numel() * 2
    if isinstance(w, Fp8Block):
        return w.weight[0].numel() + w.scale[0].numel() * 4
    return w[0].numel() * 2


def tune(layer: Layer, tokens: list[int], bandwidth: float, repeats: int) -> tuple[Tiles, list[dict]]:
    """The tiles with the least summed time over floor across `tokens`: gate-up and down swept apart,
    then the pipeline depth."""
    sweep, best = [], {}
    for which in ("gate", "down"):
        scores = {}
        # a packed INT4 step of 128 columns is 64 bytes a row: wider steps keep as many bytes in flight
        steps = SWEEP_STEPS + ((512, 1024) if layer.quant == "int4" else ())
        for cols, step, warps in itertools.product(SWEEP_COLS, steps, SWEEP_WARPS):
            tiles = replace(Tiles(), **{f"{which}_cols": cols, f"{which}_step": step, f"{which}_warps": warps})
            ms = fits(lambda t: time_ms(layer.kernel(which, t, tiles), repeats) / layer.copies, tokens)
            if ms is None:
                continue
            score = sum(ms[t] / layer.floor_ms(t, bandwidth) for t in tokens)
            sweep.append({"kernel": which, "cols": cols, "step": step, "warps": warps, "ms": ms})
            print(f"  tune {which}: cols {cols} step {step} warps {warps}: "
                  + " ".join(f"T{t} {ms[t]:.3f}" for t in tokens) + " ms", flush=True)
            scores[(cols, step, warps)] = score
        best[which] = min(scores, key=scores.get)
    (gc, gs, gw), (dc, ds, dw) = best["gate"], best["down"]
    scores = {}
    for stages in SWEEP_STAGES:  # then the pipeline depth of both, the whole layer timed
        tiles = Tiles(gc, gs, gw, dc, ds, dw, stages)
        ms = fits(lambda t: time_ms(layer.run("fused", t, tiles), repeats) / layer.copies, tokens)
        if ms is None:
            continue
        sweep.append({"kernel": "both", "stages": stages, "ms": ms})
        scores[tiles] = sum(ms[t] / layer.floor_ms(t, bandwidth) for t in tokens)
    return min(scores, key=scores.get), sweep


def bench_shape(name: str, args, bandwidth: float, quant: str = "bf16") -> dict:
    device = torch.device("cuda")
    layer = Layer(name, device, args.tokens, quant)
    key = fused_moe.shape_key(layer.e, layer.h, layer.i, layer.k, quant)
    out: dict = {"key": key, "quant": quant, "copies": layer.copies, "expert_bytes": layer.expert_bytes,
                 "tokens": {}}
    tiles = layer_tiles(name, quant, args.tiles)
    paths = args.paths if quant == "bf16" else ["fused"]  # the other paths read bfloat16 weights
    if args.tune:
        tiles, out["sweep"] = tune(layer, args.tune_tokens or args.tokens, bandwidth, args.repeats)
    out["tiles"] = asdict(tiles)
    print(f"{name} ({quant}): hidden {layer.h}, expert width {layer.i}, {layer.e} experts, top {layer.k}; "
          f"{layer.copies} copies of the layer; tiles {out['tiles']}")
    print(f"{'T':>4}{'experts':>9}{'floor ms':>10}" + "".join(f"{p + ' ms':>14}" for p in paths)
          + f"{'fused/floor':>13}")
    for t in args.tokens:
        row = {"experts": layer.distinct(t), "floor_ms": layer.floor_ms(t, bandwidth)}
        for path in paths:
            pairs_bytes = t * layer.k * layer.expert_bytes
            if path == "gathered" and pairs_bytes > GATHER_LIMIT:
                continue
            row[path + "_ms"] = time_ms(layer.run(path, t, tiles), args.repeats, graph=path != "loop") / layer.copies
        if "fused_ms" in row:
            row["fused_floor_ratio"] = row["floor_ms"] / row["fused_ms"]
            row.update(check_fused(layer, t, tiles))
        out["tokens"][str(t)] = row
        cells = "".join(f"{row[p + '_ms']:14.3f}" if p + "_ms" in row else f"{'-':>14}" for p in paths)
        frac = f"{row['fused_floor_ratio']:13.0%}" if "fused_ms" in row else ""
        print(f"{t:>4}{row['experts']:>9}{row['floor_ms']:10.3f}{cells}{frac}")
    return out


@torch.inference_mode()
def check_fused(layer: Layer, t: int, tiles: Tiles) -> dict:
    """The fused result against the grouped matmul's (relative max error; INT4: on the touched
    experts dequantized), and whether each token's row is bitwise the same computed alone as among
    the t tokens."""
    x, experts, weights = layer.inputs[t]
    gu, dn = layer.stacks[0]
    got = fused_moe.fused_moe(x, experts, weights, gu, dn, tiles=tiles)
    out = {"rows_bitwise_alone": None, "rel_err_vs_grouped": None}
    quantized = isinstance(gu, (Int4, Fp8Block))
    if quantized and t > 8:  # dequantizing more experts may not fit beside the stacks
        want = None
    elif quantized:  # only the touched experts, renumbered: a whole stack dequantized may not fit
        used = experts.unique()
        sub = [dataclasses.replace(w, **{f.name: getattr(w, f.name)[used] for f in dataclasses.fields(w)
                                         if isinstance(getattr(w, f.name), torch.Tensor)}).dequantized(x.dtype)
               for w in (gu, dn)]
        want = grouped(x, torch.searchsorted(used, experts), weights, *sub)
    else:
        want = grouped(x, experts, weights, gu, dn)
    alone = torch.cat([fused_moe.fused_moe(x[j:j + 1], experts[j:j + 1], weights[j:j + 1], gu, dn, tiles=tiles)
                       for j in range(t)])
    out["rows_bitwise_alone"] = bool(torch.equal(alone, got))
    if want is not None:
        out["rel_err_vs_grouped"] = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    return out


def run_bench_moe(args) -> dict:
    from .record import write_record

    check_args(args)
    torch.set_grad_enabled(False)
    bandwidth = copy_bandwidth(torch.device("cuda"))
    results: dict = {"bandwidth_gb_s": bandwidth / 1e9, "gpu": torch.cuda.get_device_name(), "shapes": {}}
    print(f"{results['gpu']}: copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    tuned = dict(fused_moe.TUNED)
    for name in args.shape:
        for quant in args.quant:
            label = name if quant == "bf16" else f"{name}-{quant}"
            results["shapes"][label] = r = bench_shape(name, args, bandwidth, quant)
            tuned[r["key"]] = Tiles(**r["tiles"])
            gc.collect()  # the layer's copies (tens of GB) sit in closures' reference cycles until collected
            torch.cuda.empty_cache()
    if args.tune:
        from pathlib import Path
        fused_moe.save_tiles(tuned, {"gpu": results["gpu"], "command": "eaglet bench-moe --tune"}, Path(args.tiles_out))
        print(f"tiles: {args.tiles_out}")
    flags = {k: v for k, v in vars(args).items() if k != "func"}
    path = write_record("bench-moe", flags, results, args.out)
    print(f"record: {path}")
    return results

