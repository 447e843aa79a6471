"""Issue 54 on the CPU: does a verify of T tokens give, bitwise, the logits of T one-token decode steps?
For small random shapes of each family (dense, MoE, MLA) and SmolLM2 itself in bfloat16: after the same
prefill, the positions whose logits are equal, with eaglet's attention as it runs (SDPA over the
block, masked) and with one SDPA call a query over exactly the keys it sees (`per_query`); then the
time of a decode and of verifies of 6 and 16 tokens on SmolLM2 either way (median of 5 after 2).

  .venv/bin/python bench/cpu/verify_invariance.py [--out bench/results]
"""
import argparse
import dataclasses
import statistics
import time

import torch
import torch.nn.functional as F

import eaglet.kvcache as kvcache
from eaglet.kvcache import KVCache
from eaglet.models.attention import AttnMeta
from eaglet.perf import shapes
from eaglet.perf.record import write_record
from eaglet.weights import load_model

SDPA = kvcache.attend_masked


def per_query(q, keys, vals, meta):
    """kvcache.attend_masked's result, each query attending alone over the keys its mask shows, in
    slot order: the call a decode of that token makes."""
    b, hkv, gt, d = q.shape
    t = meta.slots.shape[1]
    g = gt // t
    mask = meta.mask[:, 0]
    qv, out = q.view(b, hkv, g, t, d), q.new_empty(b, hkv, g, t, d)
    for i in range(b):
        for j in range(t):
            idx = mask[i, j].nonzero()[:, 0]
            out[i, :, :, j] = F.scaled_dot_product_attention(qv[i, :, :, j], keys[i][:, idx], vals[i][:, idx])
    return out.reshape(b, hkv * g, t, d)


def step(model, cache, ids):
    pos = cache.lens[:, None] + torch.arange(ids.shape[1])
    meta = AttnMeta.build(cache.lens, pos, int(cache.lens.max()) + ids.shape[1])
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
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
    models = {name: shapes.random_model(name, "cpu", torch.bfloat16) for name in
              ("tiny-llama", "tiny-qwen3-moe", "tiny-mla-moe")}
    models["smollm2-135m-instruct"] = load_model(None, dtype="bfloat16", device="cpu", tokenizer=False).model
    results: dict = {"equal_of_16": {}, "smollm2_ms": {}}
    for mode, attend in (("sdpa", SDPA), ("per_query", per_query)):
        kvcache.attend_masked = attend
        results["equal_of_16"][mode] = {name: equal_positions(m) for name, m in models.items()}
        results["smollm2_ms"][mode] = times(models["smollm2-135m-instruct"])
    kvcache.attend_masked = SDPA
    results["per_query_cost"] = {t: results["smollm2_ms"]["per_query"][t] / results["smollm2_ms"]["sdpa"][t]
                                 for t in results["smollm2_ms"]["sdpa"]}
    for mode, eq in results["equal_of_16"].items():
        print(f"{mode:<10} positions equal of 16:", ", ".join(f"{n} {k}" for n, k in eq.items()))
    print("per-query attention, time against SDPA (SmolLM2, context 300):",
          ", ".join(f"T={t} {r:.2f}x" for t, r in results["per_query_cost"].items()))
    print(f"record: {write_record('verify-invariance', vars(args), results, args.out)}")


if __name__ == "__main__":
    main()
