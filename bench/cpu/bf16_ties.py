"""Why speculative greedy output leaves plain greedy output in bfloat16 (it does not in float32):
for each prompt, the first token where EAGLE-3 chain-5 output and plain output differ, and there
the target's logits of the two candidates from a float32 forward and a bfloat16 forward over the
same prefix. If every split is a near-tie (the candidates within bfloat16's logit resolution), the
cause is rounding: a verify step computes a token's hidden state in a block of rows, a decode step
alone, and the sums round differently. A probe, CPU.

  .venv/bin/python bench/cpu/bf16_ties.py [--prompts mtbench] [--num-prompts 20] [--max-new-tokens 128]
"""
import argparse
import math

import torch

from eaglet.config import SpecConfig
from eaglet.datasets import load_prompts
from eaglet.generate import GenerationConfig, Generator
from eaglet.kvcache import AppendKV
from eaglet.models.attention import AttnMeta
from eaglet.perf.record import write_record
from eaglet.spec.speculator import bundled_drafter, load_speculator
from eaglet.weights import load_model


@torch.no_grad()
def last_logits(model, seq: list[int]) -> torch.Tensor:
    """The target's float32 logits for the token after `seq`, from one forward over all of it."""
    ids, pos = torch.tensor([seq]), torch.arange(len(seq))[None]
    hidden, _ = model(ids, pos, AppendKV(model.config.num_layers), AttnMeta.build(torch.zeros(1, dtype=torch.long), pos, len(seq)))
    return model.logits(hidden[0, -1]).float()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", default="mtbench")
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    bf16 = load_model(None, "bfloat16", "cpu")
    fp32 = load_model(None, "float32", "cpu").model
    tok = bf16.tokenizer
    prompts = [tok.apply_chat([{"role": "user", "content": p}]) for p in load_prompts(args.prompts)[:args.num_prompts]]
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens)
    plain = Generator(bf16.model, tok).generate(prompts, cfg)
    sp = load_speculator(SpecConfig("eagle3", str(bundled_drafter()), steps=5), bf16.model)
    spec = Generator(bf16.model, tok, sp).generate(prompts, cfg)
    splits = []
    for p, a, b in zip(prompts, plain, spec):
        d = next((j for j, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), None)
        if d is None:
            continue
        prefix, ta, tb = p + a.tokens[:d], a.tokens[d], b.tokens[d]
        l32, l16 = last_logits(fp32, prefix), last_logits(bf16.model, prefix)
        splits.append({"at": d, "plain_token": ta, "spec_token": tb, "fp32_gap": float(l32[ta] - l32[tb]),
                       "bf16_gap": float(l16[ta] - l16[tb]), "fp32_argmax": int(l32.argmax()),
                       "logit": float(l32[ta]), "bf16_spacing": 2.0 ** (math.floor(math.log2(abs(float(l32[ta])))) - 7)})
        s = splits[-1]
        print(f"token {d:3d}: plain {ta} / spec {tb}: float32 gap {s['fp32_gap']:+.4f} (logit {s['logit']:.2f}, "
              f"bfloat16 spacing there ~{s['bf16_spacing']:.3f}), bfloat16 gap {s['bf16_gap']:+.4f}")
    equal = len(prompts) - len(splits)
    worst = max((abs(s["fp32_gap"]) for s in splits), default=0.0)
    print(f"{equal} of {len(prompts)} prompts equal; every split within |float32 gap| <= {worst:.4f}")
    res = {"prompts": len(prompts), "equal": equal, "splits": splits, "max_abs_fp32_gap": worst}
    print(f"record: {write_record('bf16-ties', vars(args), res, args.out, models={'target': bf16.path, 'drafter': str(bundled_drafter())})}")


if __name__ == "__main__":
    main()
