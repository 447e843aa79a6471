"""What NCCL really ran with, rank by rank: the NCCL_* environment each worker held when its
communicator was created (what NCCL reads, once, at that moment), the environment afterwards (what
`/proc/PID/environ` or a late print would suggest), and NCCL's own debug log (NCCL_DEBUG=INFO,
NCCL_DEBUG_SUBSYS=INIT,ENV: "X set by environment to Y", the transport between each pair of ranks,
its version). `check` turns a request and the reports into errors that name the variable and the
rank; `table` prints them side by side.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..errors import InvalidInput

PREFIXES = ("NCCL_", "TORCH_NCCL_")  # what NCCL reads, and what torch's NCCL process group reads

SET_BY_ENV = re.compile(r"\b(NCCL_\w+) set by environment to (\S+?)\.?(?:\s|$)")  # 2.28 ends the line with "."
VERSION = re.compile(r"NCCL version (\S+)")
RANKS = re.compile(r"\bnranks (\d+)", re.I)  # "comm 0x... rank 0 nRanks 1 nNodes 1 ...", "... nranks 2 cudaDev"
# "Channel 00/0 : 0[0] -> 1[1] via P2P/IPC/read" (P2P/CUMEM, P2P/direct pointer), "... [send] via
# NET/Socket/3"; before NCCL 2.12 without "/0", and "via SHM/direct/direct" or "via direct shared memory"
CHANNEL = re.compile(r"Channel \d+(?:/\d+)? : (\d+)\[\w+\] -> (\d+)\[\w+\](?: \[\w+\])? via (\w+)( shared memory)?")


def parse_env_args(items: list[str] | None) -> dict[str, str]:
    """`--nccl-env KEY=VALUE ...` as a dict; anything but an NCCL setting is refused."""
    out = {}
    for item in items or []:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise InvalidInput(f"--nccl-env {item!r}: expected KEY=VALUE")
        if not key.startswith(PREFIXES):
            raise InvalidInput(f"--nccl-env {key}: not an NCCL setting (NCCL_* or TORCH_NCCL_*)")
        out[key] = value
    return out


def nccl_env(environ) -> dict[str, str]:
    return {k: v for k, v in sorted(environ.items()) if k.startswith(PREFIXES)}


@dataclass
class NcclLog:
    """What one rank's NCCL debug log says: the settings NCCL read from the environment, the
    transport it chose to each peer ("0->1": P2P, SHM or NET), its version and the communicator's
    rank count."""
    settings: dict[str, str] = field(default_factory=dict)
    transports: dict[str, str] = field(default_factory=dict)
    version: str | None = None
    ranks: int | None = None


def parse_log(text: str) -> NcclLog:
    log = NcclLog()
    for line in text.splitlines():
        if m := SET_BY_ENV.search(line):
            log.settings[m[1]] = m[2]
        elif m := CHANNEL.search(line):
            log.transports.setdefault(f"{m[1]}->{m[2]}", "SHM" if m[4] else m[3])
        elif m := VERSION.search(line):
            log.version = m[1]
        elif m := RANKS.search(line):
            log.ranks = int(m[1])
    return log


def alone(report: RankReport) -> bool:
    """A one-rank NCCL communicator: it has no peer, so NCCL skips its tuning model, where it reads
    the protocol and algorithm settings (NCCL_PROTO, NCCL_ALGO, ...); their absence from its log
    says nothing about their reaching the worker."""
    return report.log is not None and report.log.ranks == 1


@dataclass
class RankReport:
    """One worker: its backend, its NCCL_* environment at communicator creation and afterwards,
    torch's NCCL version, and NCCL's own log (None where none was captured, e.g. gloo)."""
    rank: int
    backend: str
    env_at_creation: dict[str, str]
    env_now: dict[str, str]
    version: str | None = None
    log: NcclLog | None = None


def check(requested: dict[str, str], reports: list[RankReport]) -> list[str]:
    """Every way a requested setting failed to take effect, and every NCCL setting the ranks
    disagree on; [] when all is as asked."""
    errors = []
    for key, want in requested.items():
        for r in reports:
            had = r.env_at_creation.get(key)
            if had != want:
                if r.env_now.get(key) == want:
                    errors.append(f"rank {r.rank}: {key}={want} was set only afterwards: not in effect "
                                  f"(at communicator creation: {had or 'unset'})")
                elif had is None:
                    errors.append(f"{key}={want} requested, but rank {r.rank} did not have it at "
                                  f"communicator creation")
                else:
                    errors.append(f"{key}={want} requested, but rank {r.rank} had {key}={had}")
            elif r.backend == "nccl" and r.log is not None and key.startswith("NCCL_"):
                read = r.log.settings.get(key)
                if read is None and alone(r):
                    continue  # (notes() names it)
                if read is None:
                    said = ", ".join(f"{k}={v}" for k, v in r.log.settings.items()) or "nothing"
                    errors.append(f"{key}={want} requested, but NCCL on rank {r.rank} did not report reading "
                                  f"it (its log: {said})")
                elif read != want:
                    errors.append(f"{key}={want} requested, but NCCL on rank {r.rank} read {read}")
    keys = sorted({k for r in reports for k in r.env_at_creation})
    for key in keys:
        values = [r.env_at_creation.get(key, "unset") for r in reports]
        if len(set(values)) > 1:
            errors.append(f"ranks disagree on {key}: "
                          + ", ".join(f"rank {r.rank}: {v}" for r, v in zip(reports, values)))
    return errors


def notes(requested: dict[str, str], reports: list[RankReport]) -> list[str]:
    """Requested settings a one-rank communicator had but did not report reading (not errors)."""
    return [f"rank {r.rank}: {key}={want} was in effect at communicator creation; NCCL did not log reading it "
            f"because a one-rank communicator runs no collective algorithm (NCCL tunes only with peers)"
            for key, want in requested.items() for r in reports
            if key.startswith("NCCL_") and alone(r) and r.env_at_creation.get(key) == want
            and key not in r.log.settings]


def table(reports: list[RankReport]) -> str:
    """One column per rank: backend, versions, each NCCL setting at creation (with what NCCL's log
    says it read, and any later change), and the transport to each peer."""
    rows = [("backend", [r.backend for r in reports]),
            ("torch NCCL version", [r.version or "-" for r in reports]),
            ("NCCL version (log)", [r.log.version or "-" if r.log else "-" for r in reports])]
    for key in sorted({k for r in reports for k in (*r.env_at_creation, *r.env_now)}):
        cells = []
        for r in reports:
            cell = r.env_at_creation.get(key, "unset")
            if r.log is not None and key in r.log.settings:
                cell += f" (NCCL: {r.log.settings[key]})"
            if r.env_now and r.env_now.get(key) != r.env_at_creation.get(key):
                cell += f" [later: {r.env_now.get(key, 'unset')}]"
            cells.append(cell)
        rows.append((key, cells))
    for pair in sorted({p for r in reports if r.log for p in r.log.transports}):
        rows.append((f"transport {pair}", [r.log.transports.get(pair, "-") if r.log else "-" for r in reports]))
    head = [""] + [f"rank {r.rank}" for r in reports]
    body = [[name, *cells] for name, cells in rows]
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [head, *body])
