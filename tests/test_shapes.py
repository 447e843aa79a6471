"""The random-weight shapes behind `eaglet bench --shape` and the bytes its roofline divides by."""
import dataclasses

import pytest

import torch

from eaglet.models.llama import CausalLM
from eaglet.perf.shapes import SHAPES, decode_bytes, weight_bytes


def test_roofline_bytes_of_the_8b_shapes():
    """The bytes the roofline divides by, on the meta device: Llama-3.1-8B has 8,030,261,248
    parameters (its model card); a decode step reads all but the input embedding table, plus the KV
    cache; a table tied to the head is read once, as the head."""
    with torch.device("meta"):
        llama = CausalLM(SHAPES["llama-3.1-8b"]).to(torch.bfloat16)
    assert weight_bytes(llama) == 2 * 8_030_261_248
    kv = 2 * 32 * 8 * 128 * 576 * 2
    assert decode_bytes(llama, 576) == 2 * 8_030_261_248 - 2 * 128256 * 4096 + kv
    with torch.device("meta"):
        tied = CausalLM(dataclasses.replace(SHAPES["llama-3.1-8b"], tie_embeddings=True)).to(torch.bfloat16)
    assert weight_bytes(tied) == decode_bytes(tied) == 2 * (8_030_261_248 - 128256 * 4096)


def test_moe_shapes_have_the_published_sizes_and_touched_bytes():
    """The MoE shapes on the meta device: total parameters as their model cards give them (30.5B,
    46.7B, 15.7B), and a one-token decode's bytes as their active parameters (3.3B, 12.9B, 2.4B,
    less the input embedding a lookup does not stream); a verify of T tokens reads the experts T
    tokens touch under uniform routing, E(1 - (1 - k/E)^T)."""
    from eaglet.perf.shapes import SLICES, touched_experts

    def built(name):
        with torch.device("meta"):
            return CausalLM(SHAPES[name]).to(torch.bfloat16)

    # active parameters as each card counts them: with the input embedding (Qwen, Mixtral) or without
    for name, total, active, with_emb in (("qwen3-30b-a3b", 30.5e9, 3.3e9, True), ("mixtral-8x7b", 46.7e9, 12.9e9, True),
                                          ("deepseek-v2-lite", 15.7e9, 2.4e9, False)):
        m = built(name)
        emb = m.model.embed_tokens.weight.numel() if with_emb else 0
        assert abs(weight_bytes(m) / 2 / total - 1) < 0.005, name
        assert abs((decode_bytes(m) / 2 + emb) / active - 1) < 0.03, name
    m = built("qwen3-30b-a3b")
    per_expert = 3 * 2048 * 768 * 2
    assert touched_experts(128, 8, 1) == 8 and 8 < touched_experts(128, 8, 16) < 128
    more = decode_bytes(m, tokens=16) - decode_bytes(m)  # 48 layers' extra experts, rounded per layer
    assert abs(more - 48 * (touched_experts(128, 8, 16) - 8) * per_expert) <= 48
    mla = built("deepseek-v2-lite")
    assert decode_bytes(mla, 100) - decode_bytes(mla) == 27 * 576 * 100 * 2  # the latent cache: 576 values a token
    kimi = built("kimi-k2")  # the slice: dense first layer + 3 MoE layers; the whole model from them
    layer = sum(p.numel() for p in kimi.model.layers[1].parameters())
    whole = weight_bytes(kimi) / 2 + (SLICES["kimi-k2"] - 4) * layer
    assert 1.02e12 < whole < 1.05e12  # Kimi-K2: 1.04T parameters


def test_the_multi_gpu_shapes_have_their_published_sizes():
    """The shapes tensor parallelism is measured on (issue 55): Llama-3.1-70B's 70.6B parameters
    and Qwen3-235B-A22B's 235B, 22B of them active a token (their model cards), on the meta device."""
    with torch.device("meta"):
        llama = CausalLM(SHAPES["llama-3.1-70b"]).to(torch.bfloat16)
        qwen = CausalLM(SHAPES["qwen3-235b-a22b"]).to(torch.bfloat16)
    assert 70.5e9 < weight_bytes(llama) / 2 < 70.6e9
    assert 235.0e9 < weight_bytes(qwen) / 2 < 235.2e9
    c = SHAPES["qwen3-235b-a22b"]
    assert 22.1e9 < (decode_bytes(qwen) / 2 + c.vocab_size * c.hidden_size) < 22.3e9  # the embedding counted


def test_touched_bytes_of_expert_parallel_ranks_add_up_to_the_whole_models():
    """Under expert parallelism a rank reads only its own experts of those the tokens touch: what a
    verify of 16 tokens reads beyond a decode's, summed over the ranks, is the whole model's."""
    from eaglet.dist.tp import TP, local_config

    c = SHAPES["qwen3-30b-a3b"]

    def more(config):
        with torch.device("meta"):
            m = CausalLM(config).to(torch.bfloat16)
        return decode_bytes(m, tokens=16) - decode_bytes(m)

    ranks = [more(local_config(c, TP(r, 4, "ep"))) for r in range(4)]
    assert abs(sum(ranks) - more(c)) <= 4 * 48 and ranks[0] == ranks[3]  # rounded per layer and rank


def test_materializing_zeroes_the_moe_buffers():
    """A model built on the meta device and materialized holds whatever memory held until weights
    load; random_model loads none into buffers: post_materialize zeroes DeepSeek-V3's score bias and
    the expert counters (a tiny config of the kimi-k2 kind, on the CPU)."""
    k2 = SHAPES["kimi-k2"]
    tiny = dataclasses.replace(k2, hidden_size=64, intermediate_size=96, num_heads=4, num_kv_heads=4, vocab_size=256,
                               moe=dataclasses.replace(k2.moe, num_experts=16, expert_size=32),
                               mla=dataclasses.replace(k2.mla, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
                                                       qk_rope_head_dim=8, v_head_dim=8))
    model = CausalLM(tiny)
    moe = model.model.layers[1].ffn
    moe.gate.e_score_correction_bias.fill_(float("nan"))
    moe.touched.fill_(7)
    model.post_materialize()
    assert torch.equal(moe.gate.e_score_correction_bias, torch.zeros(16)) and int(moe.touched) == 0


@torch.inference_mode()
def test_random_shapes_spread_their_routing(monkeypatch):
    """A random model's MoE layers route as if uniformly (SparseMoE.route_spread): tokens whose
    hidden states share one direction (as a deep random model's do) go to a few experts as they are,
    to about E(1 - (1 - k/E)^T) with the spread; the cost curve of a random shape reports the
    distinct experts a layer touched."""
    from eaglet.models.moe import SparseMoE
    from eaglet.perf import shapes
    from eaglet.perf.curves import forward_curve

    q = SHAPES["qwen3-30b-a3b"]
    tiny = dataclasses.replace(q, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                               head_dim=16, vocab_size=256, moe=dataclasses.replace(q.moe, num_experts=64,
                                                                                      expert_size=16))
    monkeypatch.setitem(shapes.SHAPES, "tiny-moe", tiny)
    model = shapes.random_model("tiny-moe", "cpu", torch.float32)
    layer = model.model.layers[0].ffn
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 64, generator=g) + 0.002 * torch.randn(64, 64, generator=g)  # one shared direction
    distinct = {}
    for spread in (False, True):
        layer.spread = spread
        distinct[spread] = layer.route(x)[1].unique().numel()
    want = shapes.touched_experts(64, 8, 64)  # 63.9
    assert distinct[False] < 20 and distinct[True] > 0.95 * want
    experts: dict = {}
    forward_curve(model, (1, 64), 32, graphs=False, repeats=1, experts=experts)
    assert experts["1"] == 8 and experts["64"] > 0.95 * want
    assert all(m.spread for m in model.modules() if isinstance(m, SparseMoE))


def test_bench_shape_of_a_sliced_moe_shape(monkeypatch, tmp_path):
    """`eaglet bench --shape` on a tiny sliced MLA + MoE shape (the kimi-k2 kind, on the CPU): the
    forward curve with the distinct experts a layer touched and the bytes ratios; an untrained
    EAGLE-3 head's speculation (τ near 1, milliseconds a step); the slice's figures: one MoE layer's
    cost from the slice timed again with one MoE layer, the 61-layer model's from it; transformers'
    model of the same tensors decoding beside it; a record."""
    import json

    from eaglet.cli import main
    from eaglet.perf import shapes

    k2 = SHAPES["kimi-k2"]
    tiny = dataclasses.replace(k2, hidden_size=64, intermediate_size=96, num_heads=4, num_kv_heads=4, vocab_size=256,
                               head_dim=8, moe=dataclasses.replace(k2.moe, num_experts=16, expert_size=32, n_group=1,
                                                       topk_group=1),
                               mla=dataclasses.replace(k2.mla, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
                                                       qk_rope_head_dim=8, v_head_dim=8))
    monkeypatch.setitem(shapes.SHAPES, "tiny-k2", tiny)
    monkeypatch.setitem(shapes.SLICES, "tiny-k2", 61)
    assert main(["bench", "--shape", "tiny-k2", "--device", "cpu", "--context", "32", "--max-new-tokens", "8",
                 "--repeats", "1", "--tree", "2,2,4", "--out", str(tmp_path)]) == 0
    rec = json.loads(next(tmp_path.glob("bench-shape-tiny-k2-cpu-*.json")).read_text())["results"]
    assert rec["experts"]["1"] == 8 and rec["experts"]["1"] < rec["experts"]["16"] <= 16
    assert rec["decode"]["transformers"]["tok_s"] > 0 and rec["decode"]["eager"]["vs_transformers"] > 0
    plain = rec["decode"]["eager"]  # a step without the prefill: this round's generation less its prefill, over 7
    assert 0 < plain["first_token_s"] < plain["seconds"][0]
    assert plain["step_ms"] == pytest.approx((plain["seconds"][0] - plain["first_token_s"]) / 7 * 1e3)
    assert rec["bytes_ratio"]["1"] == 1 and rec["bytes_ratio"]["16"] > 1
    spec = rec["speculation"]
    assert set(spec) == {"eagle3-chain3", "eagle3-tree2,2,4"}
    assert all(1 <= s["accept_length"] < 2 and s["steps"] >= 4 and s["ms_per_step"] > 0 for s in spec.values())
    assert all(s["equals_plain"] for s in spec.values())  # float32: speculation changes nothing
    sl = rec["slice"]
    for t in ("1", "64"):  # the whole model: base + 60 MoE layers at one layer's cost
        assert abs(sl["whole_ms"][t] - (sl["base_ms"][t] + 60 * sl["moe_layer_ms"][t])) < 1e-9
        assert abs(sl["base_ms"][t] + 3 * sl["moe_layer_ms"][t] - rec["forward_ms"]["eager"][t]) < 1e-9


def test_a_decode_step_is_the_generation_less_its_prefill_round_by_round():
    """The step figure pairs each round's whole generation with the same round's prefill-and-first-token
    run (a slow spell falls on both), then takes the median: here 0.1 s a step, where unpaired medians
    would say 0.2."""
    from eaglet.perf.bench_shape import decode_steps

    d = decode_steps([1.0, 2.0, 3.0], [0.1, 1.5, 0.2], 10)
    assert d["step_ms"] == pytest.approx(100.0) and d["steps_tok_s"] == pytest.approx(10.0)
    assert d["first_token_s"] == pytest.approx(0.2)
    assert decode_steps([1.0], [0.5], 1) == {}  # one token: no step after the first


TINY = dict(hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
            vocab_size=256)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v2-lite", "kimi-k2"])
@torch.inference_mode()
def test_transformers_twin_holds_the_same_weights(monkeypatch, name):
    """transformers' model of a random shape, given eaglet's tensors (no copy: the same storage),
    computes eaglet's logits: the side-by-side baseline of `bench --shape` runs the same weights.
    Tiny versions of the MoE shapes (MLA and DeepSeek-V3's routing included), routed as trained
    models route (the benchmarks' spread off)."""
    from eaglet.kvcache import KVCache
    from eaglet.models.moe import SparseMoE
    from eaglet.perf import shapes
    from eaglet.perf.hf_twin import hf_twin

    from .test_model_parity import eaglet_step

    s = SHAPES[name]
    width = TINY["intermediate_size"] if s.model_type == "mixtral" else 32  # Mixtral's experts: the MLP's width
    tiny = dataclasses.replace(s, **TINY, moe=dataclasses.replace(s.moe, num_experts=16, expert_size=width,
                                                                   n_group=min(s.moe.n_group, 4),
                                                                   topk_group=min(s.moe.topk_group, 2)))
    if s.mla is not None:
        tiny = dataclasses.replace(tiny, head_dim=8, num_kv_heads=4, mla=dataclasses.replace(
            s.mla, q_lora_rank=s.mla.q_lora_rank and 32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
            v_head_dim=8))
    monkeypatch.setitem(shapes.SHAPES, "tiny", tiny)
    model = shapes.random_model("tiny", "cpu", torch.float32)
    for m in model.modules():
        if isinstance(m, SparseMoE):
            m.spread = False
    hf = hf_twin(model)
    assert hf.model.embed_tokens.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(0))
    want = eaglet_step(model, KVCache.for_model(model.config, 1, 32, torch.float32, "cpu"), ids)
    got = hf(ids).logits
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
