"""The trap of the case we start from: an NCCL setting put in each worker's environment only after its
communicator exists (what a print or /proc/PID/environ would then show as set). eaglet must name it.
  python3 bench/gpu/nccl_trap.py N [cuda|cpu]"""
import sys

from eaglet.dist.nccl import check
from eaglet.dist.workers import env_reports

if __name__ == "__main__":
    n, device = int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "cuda"
    reports = env_reports(n, device, {}, late={"NCCL_PROTO": "LL"})
    errors = check({"NCCL_PROTO": "LL"}, reports)
    print(f"--tp {n}, NCCL_PROTO=LL set in each worker after its communicator:", *errors, sep="\n  ")
    sys.exit(0 if len(errors) == n else 1)  # one error a rank: the trap caught everywhere
