"""`eaglet env`: this machine's environment, and with `--tp N` what NCCL settings each of N workers
really held when its communicator was created and what NCCL's own log says it read and chose."""
from __future__ import annotations

import dataclasses
import json
import sys
import tempfile

from .nccl import check, notes, parse_env_args, table


def add_env_parser(sub) -> None:
    e = sub.add_parser("env", help="this machine, and the NCCL settings every tensor-parallel worker ran with",
                       description="Print the environment a record would carry. With --tp N, start N workers as "
                                   "`--tp N` runs do (one a GPU; gloo on CPUs), apply --nccl-env in each before "
                                   "its communicator exists, and print per rank the NCCL_* values at "
                                   "communicator creation, what NCCL's debug log says it read and the transport "
                                   "to each peer. A requested setting that did not take effect, or ranks that "
                                   "disagree, is an error naming the variable and the rank (exit status 1).")
    e.add_argument("--tp", type=int, default=0, help="workers to start (default: none; this process only)")
    e.add_argument("--device", help="cuda (NCCL, one worker a GPU; the default where there is a GPU) or cpu (gloo)")
    e.add_argument("--nccl-env", nargs="+", metavar="KEY=VALUE", help="settings applied in every worker first")
    e.add_argument("--nccl-log-dir", help="keep NCCL's per-rank debug logs here (default: a temporary directory)")
    e.add_argument("--json", action="store_true", help="print JSON")


def device_kind(device: str | None) -> str:
    """'cuda' or 'cpu' for the workers: the flag's, else the GPU where there is one."""
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if device.startswith("cuda") else "cpu"


def cmd_env(args) -> int:
    from ..perf.record import environment
    from .workers import env_reports

    settings = parse_env_args(args.nccl_env)
    out: dict = {"environment": environment()}
    errors: list[str] = []
    if args.tp:
        device = device_kind(args.device)
        with tempfile.TemporaryDirectory(prefix="eaglet-nccl-") as tmp:
            reports = env_reports(args.tp, device, settings, log_dir=args.nccl_log_dir or tmp)
        errors = check(settings, reports)
        out.update(requested=settings, ranks=[dataclasses.asdict(r) for r in reports], errors=errors,
                   notes=notes(settings, reports))
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        env = out["environment"]
        print(f"torch {env['torch']}, python {env['python']}, {env['cpu_count']} CPUs, "
              f"GPU: {(env['gpu'] or {}).get('name', 'none')}")
        if args.tp:
            print(table(reports))
    for n in out.get("notes", []):
        print(f"eaglet: note: {n}", file=sys.stderr)
    for e in errors:
        print(f"eaglet: error: {e}", file=sys.stderr)
    return 1 if errors else 0
