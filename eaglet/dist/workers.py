"""Worker processes for tensor parallelism: one per GPU (NCCL), or gloo workers on the CPU.

`run(fn, world, device, args, settings)` starts `world` spawned workers. Each applies the NCCL
settings to its own environment *before* torch.distributed exists in it, creates its communicator
eagerly (NCCL: bound to its GPU with `device_id`, then one all-reduce, so the communicator is made
at start and not at the first step), snapshots the NCCL_* environment NCCL has just read, and runs
`fn(TP(rank, world), *args)`. Results come back pickled by value (a tensor sent through a
multiprocessing queue is a file descriptor that dies with its worker). A worker's EagletError
becomes the parent's, once; a worker that crashes or dies is named and the others are stopped.

Under `torchrun` (RANK / WORLD_SIZE / MASTER_ADDR set) there is nothing to spawn: this process is
one worker, and `run` returns its own result alone.
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue as queues
import signal
import socket
import time
import traceback
from pathlib import Path

from ..errors import EagletError, InvalidInput
from .nccl import NcclLog, RankReport, nccl_env, parse_log
from .tp import TP

TIMEOUT_S = float(os.environ.get("EAGLET_DIST_TIMEOUT", 300))  # a collective waiting longer fails
AT_CREATION: dict[str, str] = {}  # this worker's NCCL_* environment when its communicator was created
PEERS_FAILED = None  # in a spawned worker: the parent's event, set once any rank has failed
GRACE_S = 20.0  # after a rank fails, how long the others get to finish before they are stopped
GROUP: dict = {}  # this worker's group: rank, world, backend, settings asked for, every rank's AT_CREATION


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init(rank: int, world: int, device: str, settings: dict[str, str], log_dir: str | None) -> None:
    """Join the process group: settings first, then the communicator, created now."""
    global AT_CREATION
    os.environ.update(settings)
    if log_dir and device == "cuda":  # NCCL's own account, a file per rank (%p: NCCL writes the pid)
        os.environ.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,ENV",
                          NCCL_DEBUG_FILE=str(Path(log_dir) / f"nccl-rank{rank}.%p.log"))
    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        dev = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timeout, device_id=dev)
    else:
        dev = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    dist.all_reduce(torch.ones(1, device=dev))  # eager: the communicator exists before any request
    AT_CREATION = nccl_env(os.environ)
    ranks: list = [None] * world
    dist.all_gather_object(ranks, AT_CREATION)
    GROUP.update(rank=rank, world=world, backend=dist.get_backend(), requested=dict(settings), at_creation=ranks)


def summary() -> dict | None:
    """What a record of a tensor-parallel run carries: the group, the NCCL settings asked for,
    every rank's NCCL_* environment at communicator creation, and what check() finds in them.
    None outside a group."""
    if not GROUP:
        return None
    from .nccl import check

    reports = [RankReport(r, GROUP["backend"], env, {}) for r, env in enumerate(GROUP["at_creation"])]
    return {**GROUP, "errors": check(GROUP["requested"], reports)}


def worker(rank, world, device, fn, args, settings, log_dir, results, failed) -> None:
    """One spawned worker: its result, or its error, pickled onto `results`. `failed` is set by
    the parent when any rank has failed (rank 0's server watches it)."""
    global PEERS_FAILED
    PEERS_FAILED = failed
    if rank:  # Ctrl-C stops rank 0; the others follow it out (or are stopped by the parent)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["MASTER_ADDR"] = "127.0.0.1"  # (not RANK / WORLD_SIZE: those mean torchrun's data parallelism)
    try:
        init(rank, world, device, settings, log_dir)
        out = ("ok", fn(TP(rank, world), *args))
    except EagletError as e:
        out = ("error", e)
    except KeyboardInterrupt:
        out = ("error", EagletError("interrupted"))
    except BaseException as e:  # noqa: BLE001 - the parent names the rank; the traceback goes to stderr
        traceback.print_exc()
        out = ("crash", f"{type(e).__name__}: {e}")
    try:
        payload = pickle.dumps(out)
    except Exception as e:  # noqa: BLE001
        payload = pickle.dumps(("crash", f"its result could not be sent back ({e})"))
    results.put((rank, payload))
    if out[0] != "ok" or failed.is_set():
        return  # no teardown handshake with ranks that may be gone
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def run(fn, world: int, device: str = "cpu", args: tuple = (), settings: dict[str, str] | None = None,
        log_dir: str | None = None) -> list:
    """fn(TP(rank, world), *args) on `world` workers ('cuda': one a GPU, NCCL; 'cpu': gloo);
    their results in rank order. `fn` must be importable by name (spawned workers import it).
    When a rank fails (an error, a crash, an exit without a result) the others get GRACE_S to
    finish, then are stopped; the first failure in rank order is raised."""
    if world < 1:
        raise InvalidInput(f"--tp {world}: needs at least one rank")
    settings = settings or {}
    if under_torchrun():
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if size != world:
            raise InvalidInput(f"--tp {world}, but torchrun started {size} processes")
        init(rank, world, device, settings, log_dir)
        return [fn(TP(rank, world), *args)]
    if device == "cuda":
        import torch

        if torch.cuda.device_count() < world:
            raise InvalidInput(f"--tp {world} needs {world} GPUs; this machine has {torch.cuda.device_count()}")
    os.environ["MASTER_PORT"] = str(free_port())  # inherited by the workers (spawned after this)
    ctx = mp.get_context("spawn")
    results, failed = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=worker, args=(r, world, device, fn, args, settings, log_dir, results, failed))
             for r in range(world)]
    for p in procs:
        p.start()
    outs: dict[int, tuple] = {}
    deadline = None

    def fail() -> None:
        nonlocal deadline
        failed.set()
        deadline = deadline or time.monotonic() + GRACE_S

    try:
        while len(outs) < world and (deadline is None or time.monotonic() < deadline):
            try:
                try:
                    rank, payload = results.get(timeout=0.5)
                except queues.Empty:
                    for rank, p in enumerate(procs):
                        if rank not in outs and p.exitcode is not None:
                            try:  # its result may still be in the pipe
                                r, payload = results.get(timeout=2)
                            except queues.Empty:
                                outs[rank] = ("crash", f"exited (code {p.exitcode}) without a result")
                                fail()
                                break
                            rank = r
                            break
                    else:
                        continue
                    if rank in outs:
                        continue
                outs[rank] = pickle.loads(payload)
                if outs[rank][0] != "ok":
                    fail()
            except KeyboardInterrupt:  # to rank 0, which stops the others
                if procs[0].is_alive():
                    os.kill(procs[0].pid, signal.SIGINT)
                fail()
    finally:
        for p in procs:
            p.join(timeout=5 if len(outs) == world else 0.1)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
    for rank in range(world):
        kind, value = outs.get(rank, ("ok", None))
        if kind == "error":
            raise value
        if kind == "crash":
            raise EagletError(f"tensor-parallel rank {rank} failed: {value}")
    if len(outs) < world:
        missing = sorted(set(range(world)) - set(outs))
        raise EagletError(f"tensor-parallel ranks {missing} did not finish and were stopped")
    return [outs[r][1] for r in range(world)]


def env_reports(world: int, device: str, settings: dict[str, str], late: dict[str, str] | None = None,
                log_dir: str | None = None) -> list[RankReport]:
    """Each worker's RankReport. `late`: settings put into each worker's environment only after
    its communicator exists (the trap the report must expose)."""
    return run(report, world, device, (late or {}, log_dir), settings, log_dir)


def report(tp: TP, late: dict[str, str], log_dir: str | None) -> RankReport:
    import torch
    import torch.distributed as dist

    os.environ.update(late)
    backend = dist.get_backend()
    version = log = None
    if backend == "nccl":
        v = torch.cuda.nccl.version()
        version = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        if log_dir:
            torch.cuda.synchronize()
            files = sorted(Path(log_dir).glob(f"nccl-rank{tp.rank}.*.log"))
            log = parse_log("".join(f.read_text(errors="replace") for f in files)) if files else NcclLog()
    return RankReport(tp.rank, backend, dict(AT_CREATION), nccl_env(os.environ), version, log)
