"""Two eaglet packages side by side on the random-weight shapes (bench --shape's model, context 512):
plain graphed decode tok/s (128 new tokens, interleaved repeats as `eaglet bench` times them) and the
graphed forward of T tokens, each package in its own process, the packages alternating shape by
shape. A probe for a kernel change's effect, not part of the package.

  python3 bench/gpu/decode_ab.py OUT_DIR SHAPE[,SHAPE..] PACKAGE_DIR[,PACKAGE_DIR..]
      # e.g. qwen3-30b-a3b,deepseek-v2-lite .old,.   (a PACKAGE_DIR holds an eaglet/ directory)

The runs so far are in OUT_DIR/decode-ab-partial.json as each finishes; the record proper comes at the end.
"""
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

TOKENS = (1, 2, 4, 16)
NEW, CONTEXT, REPEATS = 128, 512, 5


def child(shape: str) -> dict:
    import torch

    from eaglet.generate import GenerationConfig, Generator
    from eaglet.perf.curves import forward_curve
    from eaglet.perf.shapes import random_model

    dev = torch.device("cuda")
    model = random_model(shape, dev, torch.bfloat16)
    prompt = torch.randint(0, model.config.vocab_size, (CONTEXT,), generator=torch.Generator().manual_seed(1)).tolist()
    gen = Generator(model, None, graphs=True)
    cfg = GenerationConfig(max_new_tokens=NEW, ignore_eos=True)
    tokens = gen.generate([prompt], cfg)[0].tokens  # warm-up and capture
    seconds = []
    for _ in range(REPEATS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        gen.generate([prompt], cfg)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
    gen.fresh()
    return {"decode_tok_s": NEW / statistics.median(seconds), "seconds": seconds, "tokens": tokens,
            "forward_ms": forward_curve(model, TOKENS, CONTEXT + NEW // 2, True)}


def partial(out_dir: str, shapes: list[str], packages: list[str], results: dict) -> None:
    """The runs so far in OUT_DIR/decode-ab-partial.json, so a call cut by its time limit still brings
    them back (the record proper is written once every run is done)."""
    from eaglet.perf.record import environment, to_json, write_atomic

    os.makedirs(out_dir, exist_ok=True)
    write_atomic(Path(out_dir) / "decode-ab-partial.json",
                 to_json({"kind": "decode-ab", "partial": True, "flags": {"shapes": shapes, "packages": packages},
                          "environment": environment(), "results": results}))


def main(out_dir: str, shapes: list[str], packages: list[str]) -> None:
    here = os.path.abspath(os.path.dirname(__file__))
    site = [p for p in os.environ.get("PYTHONPATH", "").split(":") if p.endswith("/site")]
    results: dict = {}
    # a package named twice (alternating repeats) keeps each run: the second under "PKG (2)"
    keys = [p if packages[:i].count(p) == 0 else f"{p} ({packages[:i].count(p) + 1})" for i, p in enumerate(packages)]
    for shape in shapes:
        for pkg, key in zip(packages, keys):
            env = {**os.environ, "PYTHONPATH": ":".join([*site, os.path.abspath(pkg)])}
            run = subprocess.run([sys.executable, os.path.join(here, "decode_ab.py"), "--child", shape], env=env,
                                 capture_output=True, text=True)
            if run.returncode:
                print(run.stderr[-3000:], flush=True)
                results.setdefault(shape, {})[key] = {"error": run.stderr[-500:]}
                continue
            r = json.loads(run.stdout.strip().splitlines()[-1])
            results.setdefault(shape, {})[key] = r
            partial(out_dir, shapes, packages, results)
            print(f"{shape:<18} {key:<8} decode {r['decode_tok_s']:7.1f} tok/s; forward ms " +
                  " ".join(f"T={t}: {ms:.3f}" for t, ms in r["forward_ms"].items()), flush=True)
        runs = [results[shape][k] for k in keys if "error" not in results[shape][k]]
        if len(runs) == len(packages) > 1:
            base, new = runs[0], runs[-1]
            results[shape]["ratio"] = {"decode": new["decode_tok_s"] / base["decode_tok_s"],
                                       "same_tokens": new["tokens"] == base["tokens"],
                                       **{t: base["forward_ms"][t] / new["forward_ms"][t] for t in new["forward_ms"]}}
            print(f"{shape:<18} {packages[-1]} over {packages[0]}: {json.dumps(results[shape]['ratio'])}", flush=True)
    from eaglet.perf.record import write_record

    flags = {"shapes": shapes, "packages": packages, "context": CONTEXT, "new_tokens": NEW, "repeats": REPEATS}
    print(f"record: {write_record('decode-ab', flags, results, out_dir)}")


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2])))
    else:
        main(sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(","))
