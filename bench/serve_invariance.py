"""Whether `eaglet serve` gives a request the same greedy reply alone and among others: the same
MT-bench requests sent one at a time, then all at once, against a server already running; how many
replies are equal, as a record (issue 54's served bar: with --exact every one, on the CPU and the GPU).

  python3 bench/serve_invariance.py --port 8391 [--requests 64] [--max-tokens 128] [--label exact] [--out DIR]
"""
import argparse
import json
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from eaglet.datasets import load_prompts  # noqa: E402
from eaglet.perf.record import write_record  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--label", default="", help="what the server runs, for the record (e.g. exact, default)")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    base = f"http://127.0.0.1:{args.port}/v1"
    model = json.load(urllib.request.urlopen(base + "/models"))["data"][0]["id"]

    def ask(prompt: str) -> str:
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}],
                           "max_tokens": args.max_tokens, "temperature": 0}).encode()
        req = urllib.request.Request(base + "/chat/completions", body, {"Content-Type": "application/json"})
        return json.load(urllib.request.urlopen(req, timeout=1800))["choices"][0]["message"]["content"]

    prompts = load_prompts("mtbench")[:args.requests]
    t0 = time.perf_counter()
    alone = [ask(p) for p in prompts]
    t1 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(ask, prompts))
    t2 = time.perf_counter()
    equal = sum(a == b for a, b in zip(alone, together))
    print(f"{args.label or 'server'}: {equal} of {len(prompts)} replies equal sent alone and {len(prompts)} at once "
          f"({t1 - t0:.1f} s and {t2 - t1:.1f} s)")
    path = write_record("serve-invariance", vars(args), {"equal": equal, "requests": len(prompts),
                                                         "seconds_alone": t1 - t0, "seconds_together": t2 - t1,
                                                         "differ": [i for i, (a, b) in enumerate(zip(alone, together))
                                                                    if a != b]},
                        args.out, raw={"replies": {"alone": alone, "together": together}})
    print(f"record: {path}")


if __name__ == "__main__":
    main()
