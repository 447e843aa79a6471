"""`eaglet bench-comm`: all-reduce latency and bandwidth over message sizes, on the workers `--tp N`
runs use (workers.py: one a GPU with NCCL and --nccl-env applied before the communicator exists,
gloo on CPUs).

Sizes: powers of two from 1 KiB to 64 MiB, and with --hidden (or --shape) the messages a decode
and a verify of T tokens send: T x hidden x the element size (2 bytes in bfloat16). Every rank
times each size: the median of --repeats eager all-reduces after --warmup, and on GPUs the median
replay of one CUDA graph of GRAPH_OPS all-reduces, divided by GRAPH_OPS. A size's latency is the
max over ranks (a collective ends when its slowest rank does); bandwidths as nccl-tests reports
them: algbw = bytes / time, busbw = algbw x 2(N-1)/N. The record and its plot feed the planner
(comm_curve.py reads the curve back); a CPU record's graph columns are null.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import InvalidInput
from ..perf.curves import time_ms
from . import workers
from .commands import device_kind
from .nccl import parse_env_args

SIZES = tuple(1 << k for k in range(10, 27))  # 1 KiB .. 64 MiB
TOKENS = (1, 2, 4, 8, 16, 32, 64)
GRAPH_OPS = 16  # all-reduces captured in one CUDA graph: a replay's time / GRAPH_OPS is one's
DTYPES = ("bfloat16", "float16", "float32")


def add_parser(sub) -> None:
    p = sub.add_parser("bench-comm", help="all-reduce latency and bandwidth over message sizes, eager and graphed",
                       description="Time all-reduces on N tensor-parallel workers (one a GPU with NCCL, gloo on "
                                   "CPUs) over message sizes from 1 KiB to 64 MiB and, with --hidden or --shape, "
                                   "the T x hidden x 2-byte messages a decode and a verify of T tokens send: "
                                   "median latency (max over ranks), algorithm and bus bandwidth, eager and (on "
                                   "GPUs) inside a CUDA graph. Writes a JSON record and a PNG the planner reads.")
    p.add_argument("--tp", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--device", help="cuda (NCCL, one worker a GPU; the default where there is a GPU) or cpu (gloo)")
    p.add_argument("--nccl-env", nargs="+", metavar="KEY=VALUE",
                   help="NCCL settings (NCCL_PROTO, NCCL_ALGO, ...) applied in every worker before its "
                        "communicator exists")
    p.add_argument("--sizes", type=int, nargs="+", metavar="BYTES", help="message sizes (default: 1 KiB to 64 MiB, x2)")
    h = p.add_mutually_exclusive_group()
    h.add_argument("--hidden", type=int, help="hidden size: adds the messages of --tokens tokens")
    h.add_argument("--shape", help="take the hidden size from a shape of eaglet/perf/shapes.py (e.g. llama-3.1-8b)")
    p.add_argument("--tokens", type=int, nargs="+", metavar="T",
                   help="with --hidden/--shape (default: 1 2 4 8 16 32 64)")
    p.add_argument("--dtype", choices=DTYPES, help="elements summed (default bfloat16 on GPUs, float32 on CPUs)")
    p.add_argument("--repeats", type=int, default=50, help="timed all-reduces (graph replays) per size; median")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls per size first")
    p.add_argument("--out", default="bench/results", help="directory for the JSON record and the PNG")
    p.add_argument("--json", action="store_true", help="print the record instead of the table")


@dataclass
class RankTimes:
    """One rank's medians, a value per size in order; graph_us None where there are no CUDA graphs."""
    rank: int
    env_at_creation: dict[str, str]
    eager_us: list[float]
    graph_us: list[float] | None


def message_sizes(args, itemsize: int) -> dict[int, int | None]:
    """{bytes: T} in increasing bytes; T where the size is the message of T tokens, else None."""
    hidden = args.hidden
    if args.shape is not None:
        from ..perf.shapes import SHAPES

        if args.shape not in SHAPES:
            raise InvalidInput(f"--shape {args.shape}: unknown (choose from {', '.join(SHAPES)})")
        hidden = SHAPES[args.shape].hidden_size
    if args.tokens and hidden is None:
        raise InvalidInput("--tokens needs --hidden or --shape")
    sizes: dict[int, int | None] = {n: None for n in args.sizes or SIZES}
    if hidden is not None:
        if hidden < 1 or any(t < 1 for t in args.tokens or TOKENS):
            raise InvalidInput("--hidden and --tokens must be positive")
        sizes.update({t * hidden * itemsize: t for t in args.tokens or TOKENS})
    for n in sizes:
        if n < 1 or n % itemsize:
            raise InvalidInput(f"--sizes {n}: a message must be a positive multiple of {itemsize} bytes "
                               f"(one {args.dtype} element)")
    return dict(sorted(sizes.items()))


def measure(tp, sizes: list[int], dtype: str, repeats: int, warmup: int) -> RankTimes:
    """On one worker: each size's median eager all-reduce and, on GPUs, graphed all-reduce (µs)."""
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dt = getattr(torch, dtype)
    buf = torch.zeros(max(sizes) // dt.itemsize, dtype=dt, device=device)  # zeros: sums never overflow
    eager, graph = [], ([] if cuda else None)
    for n in sizes:
        x = buf[: n // dt.itemsize]
        for _ in range(warmup):
            dist.all_reduce(x)
        dist.barrier()  # every rank starts timing together
        eager.append(time_ms(lambda: dist.all_reduce(x), device, repeats) * 1e3)
        if cuda:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(GRAPH_OPS):
                    dist.all_reduce(x)
            for _ in range(warmup):
                g.replay()
            graph.append(time_ms(g.replay, device, repeats) * 1e3 / GRAPH_OPS)
            del g
    return RankTimes(tp.rank, dict(workers.AT_CREATION), eager, graph)


def row(n: int, tokens: int | None, world: int, eager: list[float], graph: list[float] | None) -> dict:
    """One size: latency per rank and the max over ranks, with its bandwidths (GB/s, 1e9 bytes)."""
    out = {"bytes": n, "tokens": tokens}
    for name, per_rank in (("eager", eager), ("graph", graph)):
        us = max(per_rank) if per_rank else None
        algbw = n / us / 1e3 if us is not None else None
        out.update({f"{name}_us": us, f"{name}_us_per_rank": per_rank, f"{name}_algbw_gbps": algbw,
                    f"{name}_busbw_gbps": algbw * 2 * (world - 1) / world if us is not None else None})
    return out


def human(n: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n} B"


def print_table(res: dict) -> None:
    graphs = res["graph_note"] or f"graph: one of {res['graph_ops']} all-reduces in a CUDA graph replay"
    print(f"all-reduce over {res['world']} ranks ({res['backend']}, {res['dtype']}): max over ranks of each "
          f"rank's median of {res['repeats']}; {graphs}")
    print(f"{'size':>10}{'T':>5}{'eager us':>11}{'algbw GB/s':>12}{'busbw GB/s':>12}{'graph us':>11}{'busbw GB/s':>12}")
    cell = lambda v, w, d: f"{v:{w}.{d}f}" if v is not None else f"{'-':>{w}}"  # noqa: E731
    for r in res["rows"]:
        print(f"{human(r['bytes']):>10}{r['tokens'] or '':>5}{cell(r['eager_us'], 11, 1)}"
              f"{cell(r['eager_algbw_gbps'], 12, 3)}{cell(r['eager_busbw_gbps'], 12, 3)}"
              f"{cell(r['graph_us'], 11, 1)}{cell(r['graph_busbw_gbps'], 12, 3)}")


def plot(res: dict, path):
    """Latency and bus bandwidth against message size, log-log, eager and graphed; T-token sizes marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    xs = [r["bytes"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, style in (("eager", "o-"), ("graph", "s-")):
        if rows[0][f"{name}_us"] is not None:
            a.plot(xs, [r[f"{name}_us"] for r in rows], style, label=name)
            b.plot(xs, [r[f"{name}_busbw_gbps"] for r in rows], style, label=name)
    for r in rows:
        if r["tokens"]:
            a.annotate(f"T={r['tokens']}", (r["bytes"], r["eager_us"]), fontsize=7, textcoords="offset points",
                       xytext=(0, 6), ha="center")
    a.set_ylabel("µs per all-reduce (max over ranks)")
    b.set_ylabel("bus bandwidth GB/s")
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message bytes")
        ax.legend()
    fig.suptitle(f"all-reduce, {res['world']} ranks, {res['backend']}, {res['dtype']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def cmd_bench_comm(args) -> int:
    from ..perf.record import write_record

    settings = parse_env_args(args.nccl_env)
    device = device_kind(args.device)
    args.dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    sizes = message_sizes(args, getattr(torch, args.dtype).itemsize)
    if args.repeats < 1 or args.warmup < 0:
        raise InvalidInput("--repeats must be >= 1 and --warmup >= 0")
    ranks = workers.run(measure, args.tp, device, (list(sizes), args.dtype, args.repeats, args.warmup), settings)
    res = {"world": args.tp, "backend": "nccl" if device == "cuda" else "gloo", "dtype": args.dtype,
           "repeats": args.repeats, "warmup": args.warmup, "graph_ops": GRAPH_OPS if device == "cuda" else None,
           "graph_note": None if device == "cuda" else "no CUDA graphs on CPUs (gloo): graph columns are null",
           "nccl_requested": settings, "env_at_creation": [r.env_at_creation for r in ranks],
           "rows": [row(n, t, args.tp, [r.eager_us[i] for r in ranks],
                        [r.graph_us[i] for r in ranks] if device == "cuda" else None)
                    for i, (n, t) in enumerate(sizes.items())]}
    flags = {k: v for k, v in vars(args).items() if k != "func"}
    flags["device"] = device
    path = write_record("bench-comm", flags, res, args.out)
    png = plot(res, path.with_suffix(".png"))
    if args.json:
        print(path.read_text())
    else:
        print_table(res)
        print(f"record: {path}\nplot: {png}")
    return 0
