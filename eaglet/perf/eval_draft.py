"""`eaglet eval-draft`: accept length τ (bonus counted) and per-position acceptance of a drafter on
a prompt set, for chain and tree settings, greedy. τ depends only on the tokens (greedy, fp32),
not on the device or batching, so CPU and GPU give the same figure."""
from __future__ import annotations

import time

from ..config import SpecConfig
from ..errors import InvalidInput
from ..generate import GenerationConfig, Generator
from ..spec.metrics import SpecMetrics
from ..spec.speculator import Speculator


def parse_setting(text: str, method: str, draft: str | None) -> SpecConfig:
    """'chain:5' (5 steps) or 'tree:6,4,16' (steps, top-k, draft tokens)."""
    kind, _, nums = text.partition(":")
    try:
        vals = [int(v) for v in nums.split(",")]
    except ValueError:
        raise InvalidInput(f"bad setting {text!r}: expected chain:STEPS or tree:STEPS,TOPK,TOKENS") from None
    if kind == "chain" and len(vals) == 1:
        return SpecConfig(method, draft, steps=vals[0])
    if kind == "tree" and len(vals) == 3:
        return SpecConfig(method, draft, steps=vals[0], topk=vals[1], draft_tokens=vals[2])
    raise InvalidInput(f"bad setting {text!r}: expected chain:STEPS or tree:STEPS,TOPK,TOKENS")


def evaluate(model, tokenizer, speculator: Speculator, prompts: list[str], max_new_tokens: int,
             batch: int, ignore_eos: bool = False, categories: list[str] | None = None) -> dict:
    """Replies end at EOS, or (`ignore_eos`) run all max_new_tokens as `eaglet bench` runs them.
    With `categories` (one per prompt), the counts of each category as well, under by_category."""
    gen = Generator(model, tokenizer, speculator)
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)
    ids = [tokenizer.apply_chat([{"role": "user", "content": p}]) for p in prompts]
    labels = categories or [None] * len(ids)
    total, per = SpecMetrics(), {}  # per: category -> [metrics, prompts, new tokens]
    tokens = 0
    t0 = time.perf_counter()
    for b in range(0, len(ids), batch):
        for label, c in zip(labels[b:b + batch], gen.generate(ids[b:b + batch], cfg, text=False)):
            total.merge(c.spec)
            tokens += len(c.tokens)
            if label is not None:
                m = per.setdefault(label, [SpecMetrics(), 0, 0])
                m[0].merge(c.spec)
                m[1], m[2] = m[1] + 1, m[2] + len(c.tokens)
    out = {**total.to_dict(), "new_tokens": tokens, "seconds": time.perf_counter() - t0}
    if per:
        out["by_category"] = {k: {**m.to_dict(), "prompts": n, "new_tokens": t} for k, (m, n, t) in per.items()}
    return out
