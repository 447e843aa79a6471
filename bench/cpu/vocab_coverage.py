"""How often the target's greedy pick is outside the draft vocabulary (a token no drafter can
propose), on MT-bench and HumanEval replies, for the bundled drafter's vocabulary, for the training
data's N most frequent ids (what `train-draft --init-from D --draft-vocab N` re-chooses), and for
the bundled ids plus the data's most frequent ones they lack. Vocabularies are chosen from the
training data only; the prompt sets only measure them. A probe, CPU.

  .venv/bin/python bench/cpu/vocab_coverage.py --data DIR [DIR ...] [--sizes 16384 18432 20480]
      [--prompts mtbench humaneval] [--max-new-tokens 256] [--draft DIR] [--picks FILE]

--picks FILE keeps the target's greedy tokens per prompt set (made once, read on later runs).
"""
import argparse
import os

import torch

from eaglet.datasets import load_prompts
from eaglet.generate import GenerationConfig, Generator
from eaglet.perf.record import write_record
from eaglet.spec.drafters.eagle3_ckpt import load_eagle3
from eaglet.spec.speculator import bundled_drafter
from eaglet.train.regen import read_shards
from eaglet.train.vocab import coverage, most_frequent, token_counts
from eaglet.weights import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", nargs="+", required=True, help="directories written by `eaglet data`")
    ap.add_argument("--sizes", nargs="+", type=int, default=[16384, 18432, 20480])
    ap.add_argument("--picks", help="a .pt file of the greedy tokens per set: read if it exists, else written")
    ap.add_argument("--prompts", nargs="+", default=["mtbench", "humaneval"])
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=41)
    ap.add_argument("--draft", help="drafter directory (default: the bundled one)")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    draft = args.draft or str(bundled_drafter())
    loaded = load_model(None, "float32", "cpu")
    model, tok = loaded.model, loaded.tokenizer
    head, _ = load_eagle3(draft, model.config, torch.device("cpu"), torch.float32)
    old = head.draft_to_target()
    rows = [r for d in args.data for r in read_shards(d)]
    counts = token_counts(rows, model.config.vocab_size)
    missing = counts.clone()
    missing[old] = -1  # the bundled ids go last among the data's most frequent
    vocabs = {"bundled": old} | {f"data top {n}": most_frequent(counts, n) for n in args.sizes} | {
        f"bundled + {n - len(old)}": torch.cat([old, most_frequent(missing, n - len(old))]).sort().values
        for n in args.sizes if n > len(old)}
    cached = torch.load(args.picks) if args.picks and os.path.exists(args.picks) else {}
    res = {"training_rows": len(rows), "training_assistant_tokens": int(counts.sum()), "sets": {},
           "training_coverage": {n: coverage(counts, ids) for n, ids in vocabs.items()}}
    for name in args.prompts:
        prompts = [tok.apply_chat([{"role": "user", "content": p}]) for p in load_prompts(name)]
        if name not in cached:
            picks, gen = [], Generator(model, tok)
            for i in range(0, len(prompts), args.batch):
                out = gen.generate(prompts[i:i + args.batch], GenerationConfig(max_new_tokens=args.max_new_tokens))
                picks += [t for c in out for t in c.tokens]
            cached[name] = torch.tensor(picks)
            if args.picks:
                torch.save(cached, args.picks)
        picks = cached[name]
        cov = {n: float(torch.isin(picks, ids).float().mean()) for n, ids in vocabs.items()}
        res["sets"][name] = {"prompts": len(prompts), "tokens": len(picks), "coverage": cov}
        print(f"{name}: {len(prompts)} prompts, {len(picks)} greedy tokens; the target's pick inside the "
              "draft vocabulary: " + ", ".join(f"{n}: {c:.2%}" for n, c in cov.items()))
    print("training data: " + ", ".join(f"{n}: {c:.2%}" for n, c in res["training_coverage"].items()))
    path = write_record("vocab-coverage", vars(args), res, args.out, models={"target": loaded.path, "drafter": draft})
    print(f"record: {path}")


if __name__ == "__main__":
    main()
