"""The sampled draw under top-k / top-p on the GPU: cut_draw.py's kernels at each tile in TILES
(BLOCKxWARPS: one program a row; sSLICExWARPS[rROUNDS]: over slices at every row count; package, the
default: the package's own choice at each row count) against the torch path (a sort of each row's
vocabulary, then the compiled Gumbel-max), each captured in a CUDA graph and timed by CUDA events,
for the logits a plain step (B, V) and a tree verify (B, 16, V) draw from; and how many draws the
kernel shares with the sort. Random logits, nothing to stage. `--pick` reads a record and prints the
tile whose times sum least and the fewest rows from which that tile beat the sort at every setting:
`TILE MIN_ROWS`.

  [TILES="package 4096x16 s4096x8 s2048x4r3"] python3 bench/gpu/draw_ab.py OUT_DIR [VOCAB ...]  # default 49152 (SmolLM2), 128256
  python3 bench/gpu/draw_ab.py --pick RECORD
  [TILES=...] python3 bench/gpu/draw_ab.py --profile OUT_DIR [VOCAB]  # each kernel of a graphed draw, µs
"""
import json
import math
import os
import statistics
import sys

import torch

from eaglet import cut_draw
from eaglet.kernels import Kernels
from eaglet.perf.record import write_record
from eaglet.sampling import RowSampling, SamplingParams

SETTINGS = {"top-p 0.9": SamplingParams(0.7, top_p=0.9), "top-k 50": SamplingParams(1.0, top_k=50),
            "top-k 40, top-p 0.95": SamplingParams(1.0, top_k=40, top_p=0.95)}
SHAPES = [(1,), (16,), (64,), (1, 16), (16, 16)]  # rows (and tree nodes) ahead of the vocabulary
REPLAYS, REPEATS = 50, 5


def graphed_ms(fn) -> float:
    """Median over REPEATS of the mean time of one replay of fn's CUDA graph (REPLAYS a repeat)."""
    for _ in range(2):
        fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(REPLAYS):
            g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / REPLAYS)
    return statistics.median(times)


ROUNDS = getattr(cut_draw, "ROUNDS", None)  # the package's own, for an s-tile that names none
PACKAGE = {k: getattr(cut_draw, k) for k in ("SPLIT", "SPLIT_ROWS", "SLICE", "SLICE_WARPS", "ROUNDS", "BLOCK", "WARPS")
           if hasattr(cut_draw, k)}  # the tile "package": cut_draw's own choice at each row count


def set_tile(tile: str) -> None:
    """cut_draw's path and tile from a TILES entry (an s-tile at every row count)."""
    for k, v in PACKAGE.items():
        setattr(cut_draw, k, v)
    if tile == "package":
        return
    dims, _, rounds = tile.lstrip("s").partition("r")
    size, warps = map(int, dims.split("x"))
    if tile.startswith("s"):
        cut_draw.SPLIT, cut_draw.SLICE, cut_draw.SLICE_WARPS = True, size, warps
        cut_draw.SPLIT_ROWS = 1 << 30
        cut_draw.ROUNDS = int(rounds or ROUNDS)
    else:
        if hasattr(cut_draw, "SPLIT"):
            cut_draw.SPLIT = False
        cut_draw.BLOCK, cut_draw.WARPS = size, warps


def main(out_dir: str, vocabs: list[int]) -> None:
    dev = torch.device("cuda")
    fast = Kernels.choose(dev)
    slow = Kernels.choose(dev, disable=("draw",))
    tiles = os.environ.get("TILES", "package").split()
    cut_draw.MIN_ROWS = 1  # the kernel at every row count
    results = {}
    for v in vocabs:
        for shape in SHAPES:
            b = shape[0]
            for name, p in SETTINGS.items():
                rs = RowSampling(b, dev)
                rs.set(list(range(b)), [p] * b, [p.stream(i) for i in range(b)])
                rs.choose_mode(range(b))
                logits = (torch.randn(*shape, v, device=dev) * 3).to(torch.bfloat16)
                offset = 1 if len(shape) == 1 else torch.arange(shape[1], device=dev).expand(b, -1)
                sort = rs.pick(logits, offset, slow)
                row = {"rows": math.prod(shape), "sort": graphed_ms(lambda: rs.pick(logits, offset, slow)), "tiles": {},
                       "agree": {}}
                for tile in tiles:
                    set_tile(tile)
                    row["tiles"][tile] = graphed_ms(lambda: rs.pick(logits, offset, fast))
                    # each tile's draws against the sort's: the same but for float near-ties
                    row["agree"][tile] = float((rs.pick(logits, offset, fast) == sort).float().mean())
                results[f"{v} {'x'.join(map(str, shape))} {name}"] = row
                print(f"V {v:6d}  rows {'x'.join(map(str, shape)):6s} {name:22s} sort {row['sort'] * 1e3:7.1f} µs  "
                      + "  ".join(f"{t} {ms * 1e3:7.1f}" for t, ms in row["tiles"].items()) + f"  agree {min(row['agree'].values()):.3f}",
                      flush=True)
    print("record:", write_record("draw-ab", {"vocabs": vocabs, "tiles": tiles, "replays": REPLAYS, "repeats": REPEATS},
                                  results, out_dir))


def profile_kernels(out_dir: str, v: int) -> None:
    """Every kernel of one graphed draw (top-k 40 and top-p 0.95, the slowest setting) per tile and
    shape, from torch.profiler over REPLAYS replays: µs each and the GPU's busy time a replay, to set
    beside draw_ab's graphed time (the rest is launches and gaps)."""
    from step_profile import busy_and_launches, kernel_table  # noqa: E402 (bench/gpu is the script's path)
    from torch.profiler import ProfilerActivity, profile

    dev, fast = torch.device("cuda"), Kernels.choose(torch.device("cuda"))
    cut_draw.MIN_ROWS = 1
    p, results = SETTINGS["top-k 40, top-p 0.95"], {}
    for tile in os.environ.get("TILES", "package").split():
        set_tile(tile)
        for shape in SHAPES:
            b = shape[0]
            rs = RowSampling(b, dev)
            rs.set(list(range(b)), [p] * b, [p.stream(i) for i in range(b)])
            rs.choose_mode(range(b))
            logits = (torch.randn(*shape, v, device=dev) * 3).to(torch.bfloat16)
            offset = 1 if len(shape) == 1 else torch.arange(shape[1], device=dev).expand(b, -1)
            for _ in range(2):
                rs.pick(logits, offset, fast)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                rs.pick(logits, offset, fast)
            g.replay()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(REPLAYS):
                    g.replay()
                    torch.cuda.synchronize()  # replays apart: no overlap between them
            busy, _, _, _ = busy_and_launches(prof)
            rows = kernel_table(prof, REPLAYS)
            name = f"{tile} {'x'.join(map(str, shape))}"
            results[name] = {"kernels_us": sum(r[2] for r in rows), "busy_us": busy / REPLAYS,
                             "all": [{"name": n[:120], "count": c, "us": us} for n, c, us in rows]}
            print(f"{name:24s} kernels {results[name]['kernels_us']:7.1f} µs a replay: "
                  + "  ".join(f"{n[:28]} {c:g}x{us / c:.1f}" for n, c, us in rows), flush=True)
    print("record:", write_record("draw-profile", {"vocab": v, "replays": REPLAYS}, results, out_dir))


def pick(path: str) -> str:
    """`TILE MIN_ROWS` from a record: the tile of least summed time, and the fewest rows from
    which it was faster than the sort for every setting and shape (no such count: 0, i.e. never)."""
    rows = {k: r for k, r in json.load(open(path))["results"].items() if isinstance(r, dict) and "tiles" in r}
    tiles = next(iter(rows.values()))["tiles"]
    best = min(tiles, key=lambda t: sum(r["tiles"][t] for r in rows.values()))
    counts = sorted({r["rows"] for r in rows.values()})
    wins = [c for c in counts if all(r["tiles"][best] <= r["sort"] for r in rows.values() if r["rows"] >= c)]
    return f"{best} {wins[0] if wins else 0}"


if __name__ == "__main__":
    if sys.argv[1] == "--pick":
        print(pick(sys.argv[2]))
    elif sys.argv[1] == "--profile":
        profile_kernels(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 49152)
    else:
        main(sys.argv[1], [int(x) for x in sys.argv[2:]] or [49152, 128256])
