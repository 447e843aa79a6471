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
import socket
import traceback
from pathlib import Path

from ..errors import EagletError, InvalidInput
from .nccl import NcclLog, RankReport, nccl_env, parse_log
from .tp import TP

TIMEOUT_S = float(os.environ.get("EAGLET_DIST_TIMEOUT", 300))  # a collective waiting longer fails
AT_CREATION: dict[str, str] = {}  # this worker's NCCL_* environment when its communicator was created


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


def worker(rank, world, device, fn, args, settings, log_dir, results) -> None:
    """One spawned worker: its result, or its error, pickled onto `results`."""
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    try:
        init(rank, world, device, settings, log_dir)
        out = ("ok", fn(TP(rank, world), *args))
    except EagletError as e:
        out = ("error", e)
    except BaseException as e:  # noqa: BLE001 - the parent names the rank; the traceback goes to stderr
        traceback.print_exc()
        out = ("crash", f"{type(e).__name__}: {e}")
    try:
        payload = pickle.dumps(out)
    except Exception as e:  # noqa: BLE001
        payload = pickle.dumps(("crash", f"its result could not be sent back ({e})"))
    results.put((rank, payload))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def run(fn, world: int, device: str = "cpu", args: tuple = (), settings: dict[str, str] | None = None,
        log_dir: str | None = None) -> list:
    """fn(TP(rank, world), *args) on `world` workers ('cuda': one a GPU, NCCL; 'cpu': gloo);
    their results in rank order. `fn` must be importable by name (spawned workers import it)."""
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
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, device, fn, args, settings, log_dir, results))
             for r in range(world)]
    for p in procs:
        p.start()
    outs: dict[int, tuple] = {}
    try:
        while len(outs) < world:
            try:
                rank, payload = results.get(timeout=0.5)
                outs[rank] = pickle.loads(payload)
                continue
            except queues.Empty:
                pass
            for rank, p in enumerate(procs):
                if rank not in outs and p.exitcode is not None:
                    try:  # its result may still be in the pipe
                        r, payload = results.get(timeout=2)
                        outs[r] = pickle.loads(payload)
                    except queues.Empty:
                        raise EagletError(f"tensor-parallel rank {rank} exited (code {p.exitcode}) "
                                          f"without a result") from None
                    break
    finally:
        for p in procs:
            p.join(timeout=10 if len(outs) == world else 0.1)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
    for rank in range(world):
        kind, value = outs[rank]
        if kind == "error":
            raise value
        if kind == "crash":
            raise EagletError(f"tensor-parallel rank {rank} failed: {value}")
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
