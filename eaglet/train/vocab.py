"""Draft vocabulary: the `size` most frequent target ids among the loss-carrying (assistant)
tokens of the training data, sorted ascending (the SGLang/SpecForge convention)."""
from __future__ import annotations

import torch


def token_counts(rows: list[dict], vocab_size: int) -> torch.Tensor:
    """(vocab_size,) how often each target id is an assistant token of the rows."""
    ids = torch.tensor([t for r in rows for t in r["input_ids"][r["prompt_len"]:]], dtype=torch.long)
    return torch.bincount(ids, minlength=vocab_size)[:vocab_size]  # one bincount, not one per row (per-row counts were slow)


def most_frequent(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` most frequent ids (all, if `size` exceeds the vocabulary), sorted ascending; ties
    (e.g. never-seen ids) go to the lower id, so the choice is deterministic."""
    keys = sorted((-int(c), i) for i, c in enumerate(counts.tolist()))[:size]
    return torch.tensor(sorted(i for _, i in keys), dtype=torch.long)


def coverage(counts: torch.Tensor, ids: torch.Tensor) -> float:
    """Fraction of the counted (assistant) tokens inside the draft vocabulary `ids`."""
    return float(counts[ids.cpu()].sum() / max(int(counts.sum()), 1))
