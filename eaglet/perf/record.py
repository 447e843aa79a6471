"""JSON records of measurements, complete enough to reproduce or explain any figure: the
environment (versions, GPU, driver, git SHA, NCCL_*/CUDA_* variables), the command and flags,
model file hashes, and the results."""
from __future__ import annotations

import datetime
import gzip
import hashlib
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

ENV_PREFIXES = ("NCCL_", "CUDA_", "TORCH_", "PYTORCH_", "EAGLET_", "OMP_", "MKL_", "TOKENIZERS_",
                "WORLD_SIZE", "LOCAL_WORLD_SIZE")  # torchrun's world: a figure from 2 GPUs says so
CONTENT_HASH_MAX = 1 << 30  # a directory's weights up to this many bytes (drafters) are hashed whole


def git_state() -> dict:
    """The checkout's commit. Where the code runs from a copy (the GPU machine), the caller passes
    the commit in EAGLET_GIT_SHA, which wins: such a copy may carry a stale .git of its own."""
    if os.environ.get("EAGLET_GIT_SHA"):
        return {"sha": os.environ["EAGLET_GIT_SHA"], "dirty": None, "note": "sha given by EAGLET_GIT_SHA"}
    root = Path(__file__).resolve().parents[2]

    def git(*a):
        try:
            r = subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True, timeout=5)
        except (OSError, subprocess.SubprocessError):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    sha = git("rev-parse", "HEAD")
    if sha is None:
        return {"sha": None, "dirty": None, "note": "no .git and no EAGLET_GIT_SHA"}
    return {"sha": sha, "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def path_fingerprint(path: str | Path | None) -> dict | None:
    """sha256 of a model file; for a directory, of its config.json and weight files: their contents when
    they total at most CONTENT_HASH_MAX bytes (a drafter: stages of one run differ only in content),
    else their names and sizes. Either way with its size in bytes (a directory: its weight files')."""
    from ..weights.gguf_cache import file_sha256, hash_file

    if path is None:
        return None
    p = Path(path)
    h = hashlib.sha256()
    if p.is_file():
        return {"path": str(p), "sha256": file_sha256(p), "bytes": p.stat().st_size}
    weights = [f for f in sorted(p.iterdir()) if f.suffix in (".safetensors", ".bin")]
    whole = sum(f.stat().st_size for f in weights) <= CONTENT_HASH_MAX
    if (p / "config.json").is_file():
        h.update((p / "config.json").read_bytes())
    for f in weights:
        if whole:
            hash_file(h, f)  # chunk by chunk: the digest of the whole bytes, without holding them
        else:
            h.update(f"{f.name}:{f.stat().st_size}".encode())
    return {"path": str(p), ("sha256-config-and-weights" if whole else "sha256-config-and-sizes"): h.hexdigest(),
            "bytes": sum(f.stat().st_size for f in weights)}


SECRET = ("KEY", "TOKEN", "SECRET", "PASSWORD")  # names whose values a record never holds


def secret(name: str) -> bool:
    """Whether a flag or variable name holds a credential (API_KEY, HF_TOKEN; not TOKENIZERS_...)."""
    return any(w in SECRET for w in name.upper().replace("-", "_").split("_"))


def redact_argv(argv: list[str]) -> list[str]:
    """argv with the values of secret flags (--api-key KEY, --api-key=KEY) hidden."""
    out, hide = [], False
    for a in argv:
        flag, eq, _ = a.partition("=")
        if hide:
            out.append("<redacted>")
        elif eq and flag.startswith("--") and secret(flag):
            out.append(f"{flag}=<redacted>")
        else:
            out.append(a)
        hide = a.startswith("--") and not eq and secret(a)
    return out


def redact(flags: dict) -> dict:
    return {k: ("<redacted>" if secret(k) and v is not None else v) for k, v in flags.items()}


def cpu_model() -> str | None:
    """The processor's name as Linux reports it (/proc/cpuinfo), else platform's."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    name = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "")
    return name or platform.processor() or None


def environment() -> dict:
    import torch

    env = {
        "time_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "git": git_state(),
        "env": {k: "<redacted>" if secret(k) else v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)},
        "argv": redact_argv(sys.argv),
    }
    for dist in ("transformers", "triton", "gguf", "safetensors", "tokenizers", "numpy"):
        try:
            env[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            env[dist] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = {"name": props.name, "count": torch.cuda.device_count(),
                      "memory_gb": round(props.total_memory / 2**30, 1), "cuda": torch.version.cuda,
                      "capability": f"{props.major}.{props.minor}"}
        try:
            env["gpu"]["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=10).stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            env["gpu"]["driver"] = None
    else:
        env["gpu"] = None
        env["cpu"] = platform.processor() or platform.machine()
    env["cpu_model"] = cpu_model()  # the host's too where a GPU runs: a loaded server's step is the host's work
    from ..models.linear import cpu_matmul

    env["cpu_matmul"] = cpu_matmul()  # the few-row matmul this host's CPU runs were timed with (None: none ran)
    from ..dist.workers import summary

    env["tensor_parallel"] = summary()  # the NCCL settings every rank held at communicator creation
    return env


def gpu_peak_memory() -> dict | None:
    """This process's peak GPU memory so far, in GiB: what its tensors held at most (allocated) and
    what the caching allocator kept from the driver (reserved, what another process cannot use).
    None when the process never touched a GPU."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    return {"peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2)}


def write_record(kind: str, flags: dict, results: dict, out_dir: str | Path, models: dict | None = None,
                 raw: dict | None = None) -> Path:
    """Write {kind, flags, environment, models, results} as JSON; returns the file path. Each `raw`
    entry (bulky raw data, e.g. a load test's per-request times) goes gzipped beside it, as
    <record>.<name>.json.gz, and results[name] names that file (read it back with load_raw)."""
    rec = {"kind": kind, "flags": redact(flags), "environment": environment(),
           "models": {k: path_fingerprint(v) for k, v in (models or {}).items()}, "results": dict(results)}
    if (mem := gpu_peak_memory()) is not None:
        rec["results"].setdefault("gpu_memory", mem)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dev = "gpu" if rec["environment"]["gpu"] else "cpu"
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = out / f"{kind}-{dev}-{stamp}.json"
    from ..dist.workers import GROUP

    if GROUP.get("rank"):  # rank 0 writes a tensor-parallel run's records
        return path
    for name, data in (raw or {}).items():  # first: a record never names a file that is not whole
        side = path.with_name(f"{path.stem}.{name}.json.gz")
        write_atomic(side, gzip.compress(json.dumps(data, separators=(",", ":")).encode(), mtime=0))
        rec["results"][name] = {"file": side.name, "count": len(data)}
    write_atomic(path, to_json(rec))
    return path


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write through a temporary file and rename: readers see the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    if isinstance(data, str):
        tmp.write_text(data, encoding="utf-8")
    else:
        tmp.write_bytes(data)
    os.replace(tmp, path)


def load_raw(record_path: str | Path, name: str):
    """The raw data a record keeps beside it under `name` (write_record's `raw`)."""
    p = Path(record_path)
    ref = json.loads(p.read_text())["results"][name]
    return json.loads(gzip.decompress((p.parent / ref["file"]).read_bytes()))


_NUMBER_LIST = re.compile(r"\[\n\s*(-?[0-9][-+0-9.eE]*(?:,\n\s*-?[0-9][-+0-9.eE]*)*)\n\s*\]")


def to_json(rec: dict) -> str:
    """Indented JSON with every list of plain numbers on one line (a serving record holds tens of
    thousands of per-token times; one per line would triple its size)."""
    text = json.dumps(rec, indent=1, default=str)
    return _NUMBER_LIST.sub(lambda m: "[" + re.sub(r",\n\s*", ", ", m.group(1)) + "]", text)
