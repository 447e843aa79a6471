"""`--exact` (Kernels.exact, models/exact.py) on the CPU in bfloat16: the logits of each position of
a 16-token verify equal, bitwise, those of 16 one-token decode steps, for a dense, an MoE and an
MLA + MoE model; a row's tokens are the same alone and in a batch; speculative greedy output equals
plain greedy output for every drafter shape (chain, tree, n-gram)."""
import argparse
import dataclasses

import pytest
import torch

from eaglet.args import add_model_args, model_kernels
from eaglet.config import SpecConfig
from eaglet.datasets import load_prompts
from eaglet.generate import GenerationConfig, Generator
from eaglet.kernels import Kernels
from eaglet.kvcache import KVCache
from eaglet.models.attention import AttnMeta
from eaglet.perf import shapes
from eaglet.spec.speculator import load_speculator
from eaglet.weights import load_model

EXACT = Kernels(exact=True)


def tiny(name: str, **kw):
    c = shapes.SHAPES[name]
    return dataclasses.replace(c, hidden_size=64, intermediate_size=96, num_layers=4, num_heads=4, vocab_size=256, **kw)


def configs() -> dict:
    qwen, kimi = shapes.SHAPES["qwen3-30b-a3b"], shapes.SHAPES["kimi-k2"]
    return {
        "llama": tiny("llama-3.1-8b", num_kv_heads=2, head_dim=16),
        "qwen3-moe": tiny("qwen3-30b-a3b", num_kv_heads=2, head_dim=16,
                          moe=dataclasses.replace(qwen.moe, num_experts=8, top_k=2, expert_size=32)),
        "mla-moe": tiny("kimi-k2", num_kv_heads=4, head_dim=8,
                        moe=dataclasses.replace(kimi.moe, num_experts=8, top_k=2, expert_size=32, n_group=1,
                                                topk_group=1),
                        mla=dataclasses.replace(kimi.mla, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
                                                qk_rope_head_dim=8, v_head_dim=8)),
    }


def forward(model, cache, ids):
    pos = cache.lens[:, None] + torch.arange(ids.shape[1])
    meta = AttnMeta.build(cache.lens, pos, int(cache.lens.max()) + ids.shape[1], kernels=model.kernels)
    hidden, _ = model(ids, pos, cache, meta)
    cache.advance(ids.shape[1])
    return model.logits(hidden)


@pytest.mark.parametrize("name", ["llama", "qwen3-moe", "mla-moe"])
@torch.inference_mode()
def test_a_verify_of_16_gives_the_logits_of_16_decode_steps_bitwise(name, monkeypatch):
    monkeypatch.setitem(shapes.SHAPES, name, configs()[name])
    model = shapes.random_model(name, "cpu", torch.bfloat16, kernels=EXACT)
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    block, alone = (KVCache.for_model(model.config, 1, 64, torch.bfloat16, "cpu") for _ in range(2))
    forward(model, block, ids[:, :8])
    forward(model, alone, ids[:, :8])
    verified = forward(model, block, ids[:, 8:])
    decoded = torch.cat([forward(model, alone, ids[:, i:i + 1]) for i in range(8, 24)], 1)
    assert all(torch.equal(verified[0, i], decoded[0, i]) for i in range(16))


@pytest.fixture(scope="module")
def smollm2_exact():
    return load_model(None, torch.bfloat16, "cpu", kernels=EXACT)


def test_a_row_alone_and_in_a_batch_and_speculation_against_plain(smollm2_exact):
    """SmolLM2 in bfloat16, the first 4 MT-bench prompts: batched, each gives its tokens alone (its
    prefill padded to another length, its decode beside other rows; without --exact the first and
    third part within 16 tokens), and EAGLE-3 chain and tree and n-gram speculation give plain
    greedy decoding's tokens."""
    lm = smollm2_exact
    prompts = [lm.tokenizer.apply_chat([{"role": "user", "content": p}]) for p in load_prompts("mtbench")[:4]]
    cfg = GenerationConfig(max_new_tokens=16)
    plain = Generator(lm.model, None, graphs=False)
    alone = [plain.generate([p], cfg)[0].tokens for p in prompts]
    assert [r.tokens for r in plain.generate(prompts, cfg)] == alone
    for spec in (SpecConfig("eagle3", steps=3), SpecConfig("eagle3", steps=3, topk=4, draft_tokens=8),
                 SpecConfig("ngram", steps=4)):
        gen = Generator(lm.model, None, load_speculator(spec, lm.model, None), graphs=False)
        out = [gen.generate([p], cfg)[0] for p in prompts]
        assert [r.tokens for r in out] == alone, spec
        if spec.method == "eagle3":  # the verify took drafted tokens, not only its own bonus token
            assert max(r.spec.accept_length for r in out) > 1.5


def test_the_flag_builds_exact_kernels_on_the_cpu():
    p = argparse.ArgumentParser()
    add_model_args(p)
    assert model_kernels(p.parse_args(["--device", "cpu", "--exact"])).exact
    assert model_kernels(p.parse_args(["--device", "cpu", "--exact", "--no-compile"])).exact
    assert not model_kernels(p.parse_args(["--device", "cpu"])).exact
