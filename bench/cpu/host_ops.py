"""Which tensor operators `eaglet serve`'s engine thread issues outside its step bodies while serving:
SmolLM2 on the CPU with the model's cost taken away (serve_host_load.py's model_without_cost: every
graph-runner body runs once per key, later calls return its outputs), a dispatch mode around the
engine thread, `eaglet bench-serve` from its own process (128-token ShareGPT requests; a warm-up
run, then the counted one). On the GPU each of these operators is a launch the host makes beside
the graphs' replays, and one that copies from pageable host memory (a device index built from a
Python list) makes the host wait for the steps in flight. Counted by operator and the eaglet lines
that issued it; a body run for a new key in the counted run shows up as its model's operators.
A probe, CPU.

  .venv/bin/python bench/cpu/host_ops.py [--system tree:4,4,16] [--concurrency 16] [--num-requests 256]
"""
import argparse
import collections
import sys
import traceback
from pathlib import Path

from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).parent))
from inprocess import bench_serve, serving  # noqa: E402
from serve_host_load import model_without_cost, system  # noqa: E402

from eaglet.generate import Generator  # noqa: E402
from eaglet.perf.record import write_record  # noqa: E402
from eaglet.server import engine as engine_mod  # noqa: E402
from eaglet.server.app import build_app  # noqa: E402

VIEWS = {"view", "_unsafe_view", "expand", "slice", "select", "unsqueeze", "squeeze", "t", "transpose", "alias",
         "detach", "permute", "reshape", "unbind", "as_strided", "lift_fresh", "sym_size", "sym_stride", "stride",
         "flatten", "_reshape_alias"}


class Ops(TorchDispatchMode):
    """Counts (operator, the three innermost eaglet frames) while `on`."""

    def __init__(self):
        super().__init__()
        self.on, self.counts = False, collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.on and func.overloadpacket.__name__ not in VIEWS:
            frames = [f for f in traceback.extract_stack() if "/eaglet/" in f.filename][-3:]
            where = " < ".join(f"{f.filename.split('/eaglet/')[-1]}:{f.name}" for f in reversed(frames))
            self.counts[(func.overloadpacket.__name__, where)] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--system", default="tree:4,4,16", help="plain, chain:S or tree:S,K,N")
    ap.add_argument("--prompts", default=".gpudata/sharegpt_first_turns.json")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    loaded, base = model_without_cost(3)
    ops = Ops()
    inner = engine_mod.Engine._run

    def run(self):
        with ops:  # dispatch modes are per thread: entered in the engine's own
            inner(self)
    engine_mod.Engine._run = run
    app = build_app(Generator(loaded.model, loaded.tokenizer, system(base, args.system)), "m",
                    max_batch=args.concurrency, max_len=1024)
    with serving(app, 8711):
        bench_serve(8711, args.prompts, args.num_requests // 4, args.concurrency)  # warm-up: every key's body
        ops.on = True
        rec = bench_serve(8711, args.prompts, args.num_requests, args.concurrency)
        ops.on = False
    steps, admissions = rec["engine"]["steps"], rec["engine"]["admissions"]
    rows = [{"op": op, "where": where, "count": n, "per_step": n / steps}
            for (op, where), n in ops.counts.most_common()]
    print(f"{args.system}: {rec['completed']} requests, {steps} steps, {admissions} admissions, "
          f"{sum(ops.counts.values())} operators")
    for r in rows[:40]:
        print(f"{r['count']:7d} {r['per_step']:6.2f}/step  {r['op']:<16} {r['where']}")
    results = {"requests": rec["completed"], "steps": steps, "admissions": admissions,
               "operators": sum(ops.counts.values()), "by_site": rows}
    print("record:", write_record("host-ops", vars(args), results, args.out,
                                  models={"target": loaded.path}))


if __name__ == "__main__":
    main()
