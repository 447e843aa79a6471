"""Read a py-spy raw profile (`py-spy record --idle --threads -f raw`, as bench/gpu/serve_pyspy.sh
takes of a loaded `eaglet serve`): per thread, the share of samples where it waited (the engine on
its condition variable, the event loop in its selector, which py-spy shows as the loop's run frame)
and where it worked, with the leaf frames that took the most.

  python3 bench/cpu/pyspy_fold.py FILE[.gz] [TOP]
"""
import collections
import gzip
import sys

IDLE = ("Condition.wait", "Event.wait", "select", "poll", "_worker", "sleep", "_recv_msg", "Timer.check")


def frames(stack: str) -> tuple[str, list[str]]:
    parts = stack.split(";")
    return parts[0], [f.split(" (")[0] for f in parts[1:]]


def main(path: str, top: int = 12) -> None:
    opener = gzip.open if path.endswith(".gz") else open
    threads: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    with opener(path, "rt") as f:
        for line in f:
            stack, n = line.rsplit(" ", 1)
            thread, fr = frames(stack)
            name = thread.split(": ", 1)[-1]
            leaf = fr[-1] if fr else "?"
            # the event loop waiting in its selector shows as its run frame: no Python frame below it
            waiting = any(w in leaf for w in IDLE) or leaf in ("Runner.run", "Server.run")
            threads[name]["(waiting) " + leaf if waiting else " > ".join(fr[-3:])] += int(n)
    for name, c in threads.items():
        total = sum(c.values())
        idle = sum(v for k, v in c.items() if k.startswith("(waiting)"))
        print(f"{name}: {total} samples, waiting {idle / total:.1%}, working {1 - idle / total:.1%}")
        for k, v in c.most_common(top):
            print(f"  {v / total:6.1%}  {k[:160]}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 12)
