"""What the code requests (bench/code_prompts.py) add, and that they hold none of HumanEval: a JSON record.

    .venv/bin/python bench/cpu/code_data_check.py --prompts .gpudata/code_prompts.json.gz \
        --general DIR [--code DIR] [--shards 6] [--out bench/results]

- HumanEval overlap: every sentence of over 40 characters of the 164 HumanEval prompts' docstrings,
  normalized (eaglet.datasets.normalize), looked for in the normalized code prompts.
- General data (`--general`, an `eaglet data` directory): how many of its first `--shards` shards'
  user turns carry eaglet's HumanEval wrapper, and how many hold a `def`.
- Code data (`--code`, the replies `eaglet data --source` wrote to the code prompts): how many replies
  of its first shards repeat the prompt's `def` line, and their median length in tokens.
"""
from __future__ import annotations

import argparse
import gzip
import json
import re
import statistics

from eaglet.datasets import HUMANEVAL_TEMPLATE, humaneval_problems, normalize
from eaglet.default_model import default_model_path
from eaglet.perf.record import write_record
from eaglet.train.regen import read_shards
from eaglet.weights.loader import load_model

WRAPPER = HUMANEVAL_TEMPLATE.split("\n")[0]  # "Complete the following Python function."


def humaneval_sentences() -> dict[str, list[str]]:
    out = {}
    for r in humaneval_problems():
        quote = '"""' if '"""' in r["prompt"] else "'''"
        doc = r["prompt"].split(quote)[1] if quote in r["prompt"] else r["prompt"]
        out[r["task_id"]] = [normalize(s) for s in re.split(r"[.\n]", doc) if len(s.strip()) > 40]
    return out


def user_turn(text: str) -> str:
    return text.split("<|im_start|>user\n", 1)[-1].split("<|im_end|>", 1)[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", required=True, help="the code prompts (ShareGPT JSON, .json or .json.gz)")
    ap.add_argument("--general", required=True, help="an `eaglet data` directory of general turns")
    ap.add_argument("--code", help="the `eaglet data` directory of replies to the code prompts")
    ap.add_argument("--shards", type=int, default=6, help="shards of each directory read")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    opener = gzip.open if args.prompts.endswith(".gz") else open
    with opener(args.prompts, "rt", encoding="utf-8") as f:
        prompts = [c["conversations"][0]["value"] for c in json.load(f)]
    blob = normalize("\n".join(prompts))
    sentences = humaneval_sentences()
    found = {tid: [s for s in sents if s in blob] for tid, sents in sentences.items()}
    results = {"code_prompts": len(prompts),
               "humaneval_problems_checked": len(found),
               "humaneval_sentences_checked": sum(map(len, sentences.values())),
               "humaneval_problems_with_a_sentence_in_the_prompts": sorted(t for t, s in found.items() if s)}
    tok = load_model(str(default_model_path()), "float32", "cpu", tokenizer=True).tokenizer.hf
    general = read_shards(args.general, args.shards)
    turns = [user_turn(tok.decode(r["input_ids"][:r["prompt_len"]])) for r in general]
    results["general"] = {"dir": args.general, "turns": len(turns), "with_the_humaneval_wrapper": sum(WRAPPER in t for t in turns),
                          "with_a_def": sum("def " in t for t in turns)}
    if args.code:
        rows = read_shards(args.code, args.shards)
        repeats, lengths = 0, []
        for r in rows:
            p, a = tok.decode(r["input_ids"][:r["prompt_len"]]), tok.decode(r["input_ids"][r["prompt_len"]:])
            header = p.split("```python\n", 1)[1].split("\n", 1)[0] if "```python\n" in p else None
            repeats += bool(header) and header in a
            lengths.append(len(r["input_ids"]) - r["prompt_len"])
        results["code"] = {"dir": args.code, "replies": len(rows), "repeating_the_def_line": repeats,
                           "median_reply_tokens": statistics.median(lengths)}
    print(json.dumps(results, indent=1))
    print(f"record: {write_record('code-data-check', vars(args), results, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
