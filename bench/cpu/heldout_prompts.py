"""ShareGPT's held-out first turns as an `eaglet eval-draft --prompts` file: the conversations `eaglet data`
never trains on (its fixed split, 1% by a hash of the id; MT-bench and HumanEval prompts dropped), their first
user turns of 20 to 600 characters (requests like MT-bench's, not pasted documents), shuffled with a fixed seed,
the first N. They are what the drafter's data stands for, unseen: τ on them against τ on MT-bench tells a
domain shortfall from the head's level on general chat. CPU, a few seconds.

  .venv/bin/python bench/cpu/heldout_prompts.py /tmp/sharegpt_heldout80.jsonl
  .venv/bin/python -m eaglet eval-draft --device cpu --dtype float32 --prompts /tmp/sharegpt_heldout80.jsonl \
      --max-new-tokens 256 --batch 39 --settings chain:5
"""
import argparse
import json
import random
from pathlib import Path

from eaglet.train.regen import RegenConfig, split_prompts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", help="JSONL file to write ({'prompt': ...} per line)")
    ap.add_argument("--num", type=int, default=80, help="at most this many prompts")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    _, held = split_prompts(RegenConfig(out=Path(args.out).parent, turns="first"))
    prompts = [p for _, p in held if 20 <= len(p) <= 600]
    random.Random(args.seed).shuffle(prompts)
    Path(args.out).write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts[: args.num]))
    print(f"{min(len(prompts), args.num)} of {len(held)} held-out first turns -> {args.out}")


if __name__ == "__main__":
    main()
