"""`--exact` (Kernels.exact, models/exact.py) on the CPU in bfloat16: the logits of each position of
a 16-token verify equal, bitwise, those of 16 one-token decode steps, for a dense, an MoE and an
MLA + MoE model; a row's tokens are the same alone and in a batch; speculative greedy output equals
plain greedy output for every drafter shape (chain, tree, n-gram)."""
import argparse
import dataclasses
import os

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
        # shared experts two routed widths wide beside the routed ones (DeepSeek's kind, without MLA)
        "moe-shared": tiny("qwen3-30b-a3b", num_kv_heads=2, head_dim=16,
                           moe=dataclasses.replace(qwen.moe, num_experts=8, top_k=2, expert_size=32, shared_experts=2)),
        "mla-moe": tiny("kimi-k2", num_kv_heads=4, head_dim=8,
                        moe=dataclasses.replace(kimi.moe, num_experts=8, top_k=2, expert_size=32, n_group=1,
                                                topk_group=1),
                        mla=dataclasses.replace(kimi.mla, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
                                                qk_rope_head_dim=8, v_head_dim=8)),
    }


def forward(model, cache, ids):
    pos = cache.lens[:, None] + torch.arange(ids.shape[1], device=ids.device)
    meta = AttnMeta.build(cache.lens, pos, int(cache.lens.max()) + ids.shape[1], kernels=model.kernels)
    hidden, _ = model(ids, pos, cache, meta)
    cache.advance(ids.shape[1])
    return model.logits(hidden)


@pytest.mark.parametrize("name,dev", [(n, d) for n in ("llama", "qwen3-moe", "mla-moe") for d in ("cpu", "cuda")]
                         + [("moe-shared", "cuda")]
                         + [pytest.param(n, "interpreted", marks=pytest.mark.interpreted)
                            for n in ("llama", "qwen3-moe", "moe-shared")])
@torch.inference_mode()
def test_a_verify_of_16_gives_the_logits_of_16_decode_steps_bitwise(name, dev, monkeypatch):
    """On the CPU through MKL's matmul and attention a token at a time (models/exact.py); on the GPU
    through the row-invariant matmul and norm, the fused MoE kernels and the exact attention kernel
    (models/exact_attention.py; MLA: a token at a time); "interpreted": that kernel through Triton's
    interpreter on the CPU, in float16, with the fused MoE kernels (MLA does not take it; its CPU path
    is not row-invariant in float16): a verify's shared experts take the path a decode step's take."""
    if dev == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.setitem(shapes.SHAPES, name, configs()[name])
    if dev == "interpreted":
        kernels, dtype, dev = Kernels(exact=True, cache_attention=True, moe=True), torch.float16, "cpu"
    else:
        kernels, dtype = Kernels.choose(dev, exact=True), torch.bfloat16
    model = shapes.random_model(name, dev, dtype, kernels=kernels)
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0)).to(dev)
    block, alone = (KVCache.for_model(model.config, 1, 64, dtype, dev) for _ in range(2))
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


def test_rows_admitted_while_others_decode_get_their_tokens_alone(smollm2_exact):
    """Continuous batching as the server runs it (runtime/decoder.py): four MT-bench prompts admitted
    two at a time, at steps 0 and 3, into a 4-row decoder, 16 tokens each, give each prompt's tokens
    from a decoder of its own (without --exact some part within those 16)."""
    from eaglet.runtime.decoder import Decoder

    lm, n = smollm2_exact, 16
    prompts = [lm.tokenizer.apply_chat([{"role": "user", "content": p}]) for p in load_prompts("mtbench")[:4]]

    def alone(p):
        dec = Decoder(lm.model, 1, 512, graphs=False)
        out = list(dec.admit([0], [p])[0])
        while len(out) < n:
            out += dec.step([n - len(out)])[0]
        return out

    dec = Decoder(lm.model, 4, 512, graphs=False)
    start, out = {0: [0, 1], 3: [2, 3]}, {}
    for s in range(40):
        for r, first in zip(start.get(s, []), dec.admit(start[s], [prompts[r] for r in start[s]]) if s in start else []):
            out[r] = list(first)
        limits = [n - len(out[r]) if r in out else 0 for r in range(4)]
        if not any(limits):
            break
        for r, toks in enumerate(dec.step(limits)):
            if r in out:
                out[r].extend(toks)
    assert [out[r] for r in range(4)] == [alone(p) for p in prompts]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="the MoE kernels need a GPU or Triton's interpreter")
@torch.inference_mode()
def test_an_exact_moe_layer_gives_a_token_its_bits_among_many_tokens(monkeypatch):
    """Past the kernels' 64 tokens (a batch's verify, a prefill) an exact model's MoE layer routes and
    computes 64 tokens at a time, so each token comes out as it does alone."""
    from eaglet.models.moe import SparseMoE

    monkeypatch.setitem(shapes.SHAPES, "qwen3-moe", configs()["qwen3-moe"])
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = shapes.random_model("qwen3-moe", dev, torch.float32, kernels=Kernels(exact=True, moe=True))
    layer = next(m for m in model.modules() if isinstance(m, SparseMoE))
    x = torch.randn(1, 70, 64, generator=torch.Generator().manual_seed(0)).to(dev)
    many = layer(x)
    assert all(torch.equal(layer(x[:, i:i + 1]), many[:, i:i + 1]) for i in (0, 33, 64, 69))


@pytest.mark.parametrize("spec", [SpecConfig("draft", steps=3), SpecConfig("draft", steps=3, topk=2, draft_tokens=6)],
                         ids=["chain", "tree"])
@pytest.mark.interpreted
@torch.inference_mode()
def test_speculation_through_the_exact_kernel_gives_plain_tokens(spec, monkeypatch):
    """Tiny Llama in float16 through models/exact_attention.py (Triton's interpreter): speculation with
    the model as its own draft (drafted tree levels read as pending slots, accepted paths copied to
    their final slots) gives plain greedy decoding's tokens."""
    from eaglet.spec.speculator import Speculator

    monkeypatch.setitem(shapes.SHAPES, "llama", configs()["llama"])
    model = shapes.random_model("llama", "cpu", torch.float16, kernels=Kernels(exact=True, cache_attention=True))
    prompts = [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 9)]
    cfg = GenerationConfig(max_new_tokens=10)
    plain = [r.tokens for r in Generator(model, None, graphs=False).generate(prompts, cfg)]
    out = Generator(model, None, Speculator(spec, draft_model=model), graphs=False).generate(prompts, cfg)
    assert [r.tokens for r in out] == plain
    assert max(r.spec.accept_length for r in out) > 1.5


def test_exact_models_are_graphed_only_where_attention_takes_the_kernel(monkeypatch):
    """An exact model's steps are captured only where nothing syncs with the host: half precision, no
    MLA, no sliding window (elsewhere attention runs a call a token over host-made slot lists)."""
    from eaglet.runtime.graphs import graphable

    for name, cfg in configs().items():
        monkeypatch.setitem(shapes.SHAPES, name, cfg)
    for name, dtype, kernels, want in [("llama", torch.bfloat16, EXACT, True), ("llama", torch.float32, EXACT, False),
                                       ("qwen3-moe", torch.bfloat16, EXACT, True), ("mla-moe", torch.bfloat16, EXACT, False),
                                       ("mla-moe", torch.bfloat16, Kernels(), True), ("llama", torch.float32, Kernels(), True)]:
        assert graphable(shapes.random_model(name, "cpu", dtype, kernels=kernels)) == want, (name, dtype, kernels)
    monkeypatch.setitem(shapes.SHAPES, "llama", dataclasses.replace(configs()["llama"], sliding_window=8))
    assert not graphable(shapes.random_model("llama", "cpu", torch.bfloat16, kernels=EXACT))
