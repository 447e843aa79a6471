"""Average the weights of several EAGLE-3 drafter exports (a "model soup": heads fine-tuned from one
start, on the same vocabulary, averaged parameter by parameter):

    .venv/bin/python bench/average_drafters.py OUT DRAFTER DRAFTER [DRAFTER ...]

The exports must share config.json and the draft vocabulary (d2t, t2d); floating tensors are averaged
in float32 and written back in their dtype; OUT is written whole or not at all. Nothing is trained.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from eaglet.spec.drafters.eagle3_ckpt import write_export


def average(dirs: list[Path]) -> tuple[dict, dict[str, torch.Tensor]]:
    configs = [json.loads((d / "config.json").read_text()) for d in dirs]
    if any(c != configs[0] for c in configs[1:]):
        raise ValueError("the exports' config.json differ")
    states = [load_file(str(d / "model.safetensors")) for d in dirs]
    if any(s.keys() != states[0].keys() for s in states[1:]):
        raise ValueError("the exports hold different tensors")
    out = {}
    for k, v in states[0].items():
        if v.is_floating_point():
            out[k] = (sum(s[k].float() for s in states) / len(states)).to(v.dtype)
        elif all(torch.equal(s[k], v) for s in states[1:]):
            out[k] = v  # the vocabulary maps: equal in all, or averaging would mix vocabularies
        else:
            raise ValueError(f"{k} differs between the exports (different draft vocabularies)")
    return configs[0], out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("drafters", nargs="+")
    args = ap.parse_args()
    if len(args.drafters) < 2:
        print("average_drafters: name two exports or more", file=sys.stderr)
        return 2
    try:
        config, state = average([Path(d) for d in args.drafters])
    except (ValueError, OSError) as e:
        print(f"average_drafters: {e}", file=sys.stderr)
        return 1
    out = write_export(args.out, config, state)
    print(f"averaged {len(args.drafters)} exports into {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
