"""Draft vocabulary: the `size` most frequent target ids among the loss-carrying (assistant)
tokens of the training data, sorted ascending (the SGLang/SpecForge convention)."""
from __future__ import annotations

import torch


def draft_vocab(rows: list[dict], vocab_size: int, size: int) -> torch.Tensor:
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for r in rows:
        ids = torch.tensor(r["input_ids"][r["prompt_len"]:], dtype=torch.long)
        counts += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
    size = min(size, vocab_size)
    # ties (e.g. never-seen ids) break toward lower ids so the choice is deterministic
    order = sorted(range(vocab_size), key=lambda i: (-int(counts[i]), i))[:size]
    return torch.tensor(sorted(order), dtype=torch.long)


def coverage(rows: list[dict], ids: torch.Tensor, vocab_size: int) -> float:
    """Fraction of assistant tokens inside the draft vocabulary."""
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[ids] = True
    total = hit = 0
    for r in rows:
        toks = torch.tensor(r["input_ids"][r["prompt_len"]:], dtype=torch.long)
        total += len(toks)
        hit += int(inside[toks].sum())
    return hit / max(total, 1)
