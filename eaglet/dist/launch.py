"""`--tp N` for the commands that run a model: the command itself runs on N workers (one a GPU;
gloo workers on the CPU), each loading its slice of the target (`args.shard`, passed to
load_model). Rank 0 talks to the user (prints, writes records, serves HTTP); the other ranks run
the same command with their output discarded and meet rank 0 in every collective."""
from __future__ import annotations

import dataclasses
import os
import sys

from .nccl import parse_env_args
from .tp import MOE_SPLITS, TP

COMMANDS = ("generate", "bench", "eval-draft", "profile", "serve", "train-draft")


def add_tp_args(p) -> None:
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks: one worker a GPU (gloo workers with "
                                                    "--device cpu); rank 0 prints and writes")
    p.add_argument("--moe-parallel", choices=MOE_SPLITS, default="tp",
                   help="with --tp: split each routed expert by its width over the ranks (tp), or the experts "
                        "themselves (ep: each rank holds experts/N whole)")
    p.add_argument("--nccl-env", nargs="+", metavar="KEY=VALUE",
                   help="NCCL settings applied in every worker before its communicator exists (see `eaglet env`)")


def shard(args) -> TP | None:
    """This process's slice of the target for load_model (None: the whole model)."""
    return getattr(args, "shard", None)


def launch(args, command) -> int:
    """Run command(args) on args.tp workers; rank 0's exit status."""
    from .commands import device_kind
    from .workers import run

    settings = parse_env_args(args.nccl_env)
    if getattr(args, "prompt", None) == "-":  # the workers have no terminal: read it here
        args.prompt = sys.stdin.read()
    return run(command_rank, args.tp, device_kind(args.device), (command, args), settings)[0]


def command_rank(tp: TP, command, args) -> int:
    """One worker of `launch`: the command on this rank's slice."""
    if tp.rank:
        sys.stdout = sys.stderr = open(os.devnull, "w")
    if args.device is None or args.device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            args.device = f"cuda:{torch.cuda.current_device()}"
    args.shard = dataclasses.replace(tp, moe=args.moe_parallel)
    return command(args)
