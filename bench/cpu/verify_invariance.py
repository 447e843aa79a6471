"""Issue 54 on the CPU: does a verify of T tokens give, bitwise, the logits of T one-token decode steps,
and a row alone the tokens it gets in a batch? In bfloat16, with eaglet's attention as it runs by
default (SDPA over the block, masked) and with `--exact` (Kernels.exact, models/exact.py): for small
random shapes of each family (dense, MoE, MLA + MoE) and SmolLM2, the positions of a 16-token verify
whose logits equal 16 decode steps'; on SmolLM2 the time of a decode and of verifies of 6 and 16
tokens (median of 5 after 2), and 8 MT-bench prompts x 64 tokens: plain alone, batched, and EAGLE-3
chain 3 alone (how many equal plain alone, and tokens/s).

  .venv/bin/python bench/cpu/verify_invariance.py [--out bench/results]
"""
import argparse
import dataclasses
import statistics
import time

import torch

from eaglet.config import SpecConfig
from eaglet.datasets import load_prompts
from eaglet.generate import GenerationConfig, Generator
from eaglet.kernels import Kernels
from eaglet.kvcache import KVCache
from eaglet.models.attention import AttnMeta
from eaglet.perf import shapes
from eaglet.perf.record import write_record
from eaglet.spec.speculator import load_speculator
from eaglet.weights import load_model


def step(model, cache, ids):
    pos = cache.lens[:, None] + torch.arange(ids.shape[1])
    meta = AttnMeta.build(cache.lens, pos, int(cache.lens.max()) + ids.shape[1], kernels=model.kernels)
    hidden, _ = model(ids, pos, cache, meta)
    cache.advance(ids.shape[1])
    return model.logits(hidden)


@torch.inference_mode()
def equal_positions(model, prefill: int = 8, tokens: int = 16) -> int:
    ids = torch.randint(0, model.config.vocab_size, (1, prefill + tokens), generator=torch.Generator().manual_seed(0))
    dt = next(model.parameters()).dtype
    a_cache, b_cache = (KVCache.for_model(model.config, 1, 64, dt, "cpu") for _ in range(2))
    step(model, a_cache, ids[:, :prefill])
    step(model, b_cache, ids[:, :prefill])
    block = step(model, a_cache, ids[:, prefill:])
    alone = torch.cat([step(model, b_cache, ids[:, i:i + 1]) for i in range(prefill, prefill + tokens)], 1)
    return sum(bool(torch.equal(block[0, i], alone[0, i])) for i in range(tokens))


@torch.inference_mode()
def times(model, context: int = 300) -> dict[str, float]:
    ids = torch.randint(0, model.config.vocab_size, (1, context + 16), generator=torch.Generator().manual_seed(1))
    cache = KVCache.for_model(model.config, 1, context + 32, next(model.parameters()).dtype, "cpu")
    step(model, cache, ids[:, :context])
    out = {}
    for t in (1, 6, 16):
        runs = []
        for _ in range(7):
            cache.lens.fill_(context)
            cache.host_lens[:] = context
            t0 = time.perf_counter()
            step(model, cache, ids[:, context:context + t])
            runs.append(time.perf_counter() - t0)
        out[str(t)] = statistics.median(runs[2:]) * 1e3
    return out


def tiny(name: str, **kw):
    c = shapes.SHAPES[name]
    return dataclasses.replace(c, hidden_size=64, intermediate_size=96, num_layers=4, num_heads=4, vocab_size=256,
                               **kw)


def generation(lm, n: int = 8, tokens: int = 64) -> dict:
    prompts = [lm.tokenizer.apply_chat([{"role": "user", "content": p}]) for p in load_prompts("mtbench")[:n]]
    cfg = GenerationConfig(max_new_tokens=tokens)
    plain = Generator(lm.model, None, graphs=False)
    spec = Generator(lm.model, None, load_speculator(SpecConfig("eagle3", steps=3), lm.model, None), graphs=False)
    t0 = time.perf_counter()
    alone = [plain.generate([p], cfg)[0].tokens for p in prompts]
    t1 = time.perf_counter()
    chain = [spec.generate([p], cfg)[0].tokens for p in prompts]
    t2 = time.perf_counter()
    batch = [r.tokens for r in plain.generate(prompts, cfg)]
    return {"batch_equal_alone": sum(a == b for a, b in zip(alone, batch)),
            "chain_equal_plain": sum(a == c for a, c in zip(alone, chain)), "prompts": n,
            "plain_tok_s": n * tokens / (t1 - t0), "chain_tok_s": n * tokens / (t2 - t1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    torch.manual_seed(0)
    k2 = shapes.SHAPES["kimi-k2"]
    shapes.SHAPES.update({
        "tiny-llama": tiny("llama-3.1-8b", num_kv_heads=2, head_dim=16),
        "tiny-qwen3-moe": tiny("qwen3-30b-a3b", num_kv_heads=2, head_dim=16,
                               moe=dataclasses.replace(shapes.SHAPES["qwen3-30b-a3b"].moe, num_experts=8,
                                                       top_k=2, expert_size=32)),
        "tiny-mla-moe": tiny("kimi-k2", num_kv_heads=4, head_dim=8,
                             moe=dataclasses.replace(k2.moe, num_experts=8, top_k=2, expert_size=32, n_group=1,
                                                     topk_group=1),
                             mla=dataclasses.replace(k2.mla, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
                                                     qk_rope_head_dim=8, v_head_dim=8)),
    })
    results: dict = {"equal_of_16": {}, "smollm2_ms": {}, "smollm2_generation": {}}
    for mode, kernels in (("sdpa", Kernels()), ("exact", Kernels(exact=True))):
        models = {name: shapes.random_model(name, "cpu", torch.bfloat16, kernels=kernels) for name in
                  ("tiny-llama", "tiny-qwen3-moe", "tiny-mla-moe")}
        lm = load_model(None, dtype="bfloat16", device="cpu", kernels=kernels)
        models["smollm2-135m-instruct"] = lm.model
        results["equal_of_16"][mode] = {name: equal_positions(m) for name, m in models.items()}
        results["smollm2_ms"][mode] = times(lm.model)
        results["smollm2_generation"][mode] = generation(lm)
    results["exact_cost"] = {t: results["smollm2_ms"]["exact"][t] / results["smollm2_ms"]["sdpa"][t]
                             for t in results["smollm2_ms"]["sdpa"]}
    for mode, eq in results["equal_of_16"].items():
        g = results["smollm2_generation"][mode]
        print(f"{mode:<6} positions equal of 16: " + ", ".join(f"{n} {k}" for n, k in eq.items())
              + f"; SmolLM2, {g['prompts']} prompts: batch == alone {g['batch_equal_alone']}, chain 3 == plain "
              f"{g['chain_equal_plain']}; plain {g['plain_tok_s']:.1f} tok/s, chain 3 {g['chain_tok_s']:.1f}")
    print("--exact against SDPA over the block, a forward's time (SmolLM2, context 300): "
          + ", ".join(f"T={t} {r:.2f}x" for t, r in results["exact_cost"].items()))
    print(f"record: {write_record('verify-invariance', vars(args), results, args.out)}")


if __name__ == "__main__":
    main()
