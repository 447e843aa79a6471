"""An untrained EAGLE-3 head for a target: the trained drafter's shapes, taps and draft vocabulary,
its weights as a fresh head initialises them (seeded). Issue 5's "random-head run": what EAGLE-3
speculation costs when almost nothing it drafts is accepted.

  python3 bench/gpu/random_head.py MODEL DRAFTER_DIR OUT_DIR [SEED]
"""
import sys

import torch

from eaglet.spec.drafters.eagle3_ckpt import load_eagle3, save_eagle3
from eaglet.spec.drafters.eagle3_head import Eagle3Head
from eaglet.weights import load_model


def main(model: str, drafter: str, out: str, seed: int = 0) -> None:
    target = load_model(model, "float32", "cpu").model.config
    trained, _ = load_eagle3(drafter, target, torch.device("cpu"), torch.float32)
    torch.manual_seed(seed)
    head = Eagle3Head(trained.cfg)
    head.set_vocab(trained.draft_to_target())
    print(f"random head written to {save_eagle3(head, out)} (seed {seed}, from {drafter}'s shapes)")


if __name__ == "__main__":
    main(*sys.argv[1:4], *map(int, sys.argv[4:5]))
