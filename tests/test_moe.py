"""Mixture-of-Experts targets (models/moe.py) on tiny random Qwen3-MoE and Mixtral configs built with
transformers (their logits against transformers' are in test_model_parity): the config's sparse
and dense layers, the two expert paths against each other, the distinct-experts counters against
the router's choices, and greedy speculation on an MoE target equal to plain greedy decoding."""
import pytest
import torch
from safetensors import safe_open

from eaglet import GenerationConfig, Generator, load_model
from eaglet.config import ModelConfig, MoEConfig, RopeConfig, SpecConfig
from eaglet.kvcache import KVCache
from eaglet.models.attention import AttnMeta
from eaglet.models.moe import SparseMoE, by_expert, gathered, grouped

from .test_spec_greedy import SHAPES, recording, run_checked, small_draft  # noqa: F401

GREEDY = GenerationConfig(max_new_tokens=64, ignore_eos=True)


def load(tiny_dirs, family):
    return load_model(tiny_dirs[family][0], dtype="float32", device="cpu", tokenizer=False).model


def test_configs_of_the_shipped_models():
    """Qwen3-30B-A3B's and Mixtral-8x7B's config keys; Qwen's sparse step and dense layers."""
    base = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4)
    qwen = ModelConfig.from_hf(dict(base, model_type="qwen3_moe", num_experts=128, num_experts_per_tok=8,
                                    moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=2,
                                    mlp_only_layers=[3]))
    assert (qwen.moe.num_experts, qwen.moe.top_k, qwen.moe.expert_size, qwen.moe.norm_topk_prob) == (128, 8, 768, True)
    assert [qwen.moe.sparse(i) for i in range(4)] == [False, True, False, False]
    assert ModelConfig.from_hf(qwen.to_hf()) == qwen
    mix = ModelConfig.from_hf(dict(base, model_type="mixtral", num_local_experts=8, num_experts_per_tok=2))
    assert (mix.moe.num_experts, mix.moe.expert_size, mix.moe.norm_topk_prob) == (8, 96, True)
    assert all(mix.moe.sparse(i) for i in range(4)) and ModelConfig.from_hf(mix.to_hf()) == mix
    dense = ModelConfig.from_hf(dict(base, model_type="qwen3_moe", num_experts=0))
    assert dense.moe is None


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_layers_and_names(tiny_dirs, family):
    """Sparse layers hold routed experts under the checkpoint's names; fused, the state dict keeps
    them, each expert a view of the stacks."""
    model = load(tiny_dirs, family)
    kinds = [type(layer.ffn).__name__ for layer in model.model.layers]
    assert kinds == (["MLP", "SparseMoE", "SparseMoE", "SparseMoE"] if family == "qwen3_moe" else ["SparseMoE"] * 4)
    with safe_open(str(tiny_dirs[family][0] / "model.safetensors"), "pt") as f:
        assert set(model.state_dict()) - {"model.rotary.freq_factors"} == set(f.keys())  # per expert (GGUF rope factors aside)
    moe = model.model.layers[1].ffn
    assert moe.fused and moe.experts[2].linears()[2].weight.data_ptr() == moe.down[2].data_ptr()


def routed_tokens(g, n: int, e: int, k: int, h: int):
    """n random tokens of width h, each routed to k distinct of e experts with random weights."""
    x = torch.randn(n, h, generator=g)
    experts = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    return x, experts, torch.rand(n, k, generator=g)


@torch.inference_mode()
def test_gathered_grouped_and_by_expert_agree():
    """The few-token path (gathered weights, static shapes), the grouped matmul over pairs sorted by
    expert (experts without tokens included) and the expert-by-expert loop agree, whatever the number
    of tokens."""
    g = torch.Generator().manual_seed(0)
    e, k, h, i = 8, 3, 16, 12
    gate_up, down = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    for n in (1, 5, 40):
        x, experts, weights = routed_tokens(g, n, e, k, h)
        a, b = gathered(x, experts, weights, gate_up, down), by_expert(x, experts, weights, gate_up, down)
        c = grouped(x, experts, weights, gate_up, down)
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()
        assert (c - b).abs().max() <= 1e-5 * b.abs().max()


@torch.inference_mode()
def test_paths_skip_the_experts_of_another_rank():
    """Expert parallelism: a layer holding experts 8 to 15 of 16 numbers them 0 to 7 and the others'
    pairs 8 with weight 0 (SparseMoE.local); each path then adds exactly the held experts' pairs."""
    g = torch.Generator().manual_seed(1)
    e, k, h, i = 16, 3, 16, 12
    gate_up, down = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    for n in (1, 5, 40):
        x, experts, weights = routed_tokens(g, n, e, k, h)
        here = experts >= 8
        want = by_expert(x, experts, weights * here, gate_up, down)
        local, w = experts.where(here, 16) - 8, weights * here
        for path in (gathered, grouped, by_expert):
            got = path(x, local, w, gate_up[8:], down[8:])
            assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (n, path.__name__)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@torch.inference_mode()
def test_distinct_expert_counters(tiny_dirs, family):
    """Each sparse layer's `touched` adds up, forward by forward, the distinct experts its router
    chose (recomputed here from the router on the layer's input), with no host sync in the model."""
    model = load(tiny_dirs, family)
    layers = [(i, layer.ffn) for i, layer in enumerate(model.model.layers) if isinstance(layer.ffn, SparseMoE)]
    want = {i: 0 for i, _ in layers}
    inputs = {}
    hooks = [m.register_forward_pre_hook(lambda mod, args, i=i: inputs.__setitem__(i, args[0]))
             for i, m in layers]
    cache = KVCache.for_model(model.config, 2, 64, torch.float32, "cpu")
    g = torch.Generator().manual_seed(3)
    for t in (9, 1, 1, 4):  # a prefill, two decode steps, a 4-token verify
        ids = torch.randint(0, 128, (2, t), generator=g)
        pos = cache.lens[:, None] + torch.arange(t)
        model(ids, pos, cache, AttnMeta.build(cache.lens, pos, int(cache.lens.max()) + t,
                                              sliding_window=model.config.sliding_window))
        cache.advance(t)
        for i, m in layers:
            _, chosen = m.route(inputs[i].reshape(-1, inputs[i].shape[-1]))
            want[i] += len(set(chosen.flatten().tolist()))
    for h in hooks:
        h.remove()
    assert {i: int(m.touched) for i, m in layers} == want
    assert all(int(m.forwards) == 4 for _, m in layers)
    assert all(w > 4 for w in want.values())  # several experts a forward


@pytest.fixture(scope="module")
def moe_target(tiny_dirs):
    """(the tiny Qwen3-MoE target, 20 prompts, their plain greedy output)."""
    model = load(tiny_dirs, "qwen3_moe")
    prompts = [torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(s)).tolist()
               for s, n in enumerate([3, 5, 8, 13, 1, 20, 7, 9, 11, 4, 6, 2, 15, 10, 12, 17, 3, 8, 5, 19])]
    # one batch (float32: its rows decode as each would alone, test_spec_greedy's batch test)
    return model, prompts, [c.tokens for c in Generator(model, None).generate(prompts, GREEDY)]


@pytest.mark.parametrize("shape", ["chain3", "tree3x3"])
@pytest.mark.parametrize("drafter", ["eagle3", "ngram", "draft"])
def test_speculation_on_an_moe_target_equals_plain_greedy(moe_target, small_draft, drafter, shape):
    """EAGLE-3 taps of an MoE target, n-gram and a draft model, chain and tree, 20 prompts in one
    batch: plain greedy token for token, every step replayed (test_spec_greedy.run_checked)."""
    model, prompts, ref = moe_target
    outs, _ = run_checked(model, prompts, ref, recording(drafter, SpecConfig(drafter, **SHAPES[shape]), model, small_draft))
    assert sum(c.spec.accepted_tokens for c in outs) > 0


def hf_block(family: str, **cfg):
    """transformers' MoE block of a DeepSeek family with random weights (bias included), and the same
    weights as eaglet's SparseMoE of a ModelConfig built from that config."""
    import transformers
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3


    hf_cfg = getattr(transformers, {"deepseek_v2": "DeepseekV2Config", "deepseek_v3": "DeepseekV3Config"}[family])(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts_per_tok=4, **cfg)
    torch.manual_seed(0)
    block = (v2.DeepseekV2Moe if family == "deepseek_v2" else v3.DeepseekV3MoE)(hf_cfg).eval()
    with torch.no_grad():
        for t in list(block.parameters()) + list(block.buffers()):
            t.copy_(0.1 * torch.randn_like(t))
    moe = MoEConfig.from_hf(family, hf_cfg.to_dict())
    config = ModelConfig(family, 128, 64, 96, 2, 4, 4, 16, 1e-6, 256, RopeConfig(), moe=moe)
    ours = SparseMoE(config).eval()
    state = block.state_dict()
    gu, down = state.pop("experts.gate_up_proj"), state.pop("experts.down_proj")
    for e in range(moe.num_experts):
        state[f"experts.{e}.gate_proj.weight"], state[f"experts.{e}.up_proj.weight"] = gu[e, :32], gu[e, 32:]
        state[f"experts.{e}.down_proj.weight"] = down[e]
    ours.load_state_dict(state)
    ours.fuse()
    return block, ours


@pytest.mark.parametrize("family,cfg", [
    ("deepseek_v3", dict(n_routed_experts=16, n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5,
                         norm_topk_prob=True)),
    ("deepseek_v2", dict(n_routed_experts=16, n_group=4, topk_group=2, n_shared_experts=2, routed_scaling_factor=16.0,
                         topk_method="group_limited_greedy")),
    ("deepseek_v2", dict(n_routed_experts=8, n_shared_experts=1, topk_method="greedy")),
])
@torch.inference_mode()
def test_deepseek_routing_and_shared_experts_equal_transformers(family, cfg):
    """DeepSeek-V3's sigmoid scores with the correction bias on the choice, its groups scored by their
    best two experts, renormalized and scaled weights; DeepSeek-V2's softmax, greedy or within the
    groups of the best experts, scaled; both with shared experts beside: the block's output equals
    transformers' for one token (gathered path) and for many (grouped matmul), and with the Triton
    kernels (routing, experts, the shared experts as each token's extra pairs)."""
    import dataclasses

    from eaglet.kernels import EAGER
    from eaglet.models.fused_moe import foldable

    block, ours = hf_block(family, **cfg)
    se = ours.shared_experts
    assert foldable(ours.stacks()[0], se.gate_up_weight, se.down_proj.weight)
    g = torch.Generator().manual_seed(1)
    for shape in ((1, 1, 64), (3, 9, 64)):
        x = torch.randn(*shape, generator=g)
        want = block(x)
        assert (ours(x) - want).abs().max() <= 1e-5 * want.abs().max()
        ours.kernels = dataclasses.replace(EAGER, moe=True)
        assert (ours(x) - want).abs().max() <= 1e-5 * want.abs().max()
        ours.kernels = EAGER
    x = torch.randn(40, 64, generator=g)
    _, experts = ours.route(x)
    if ours.cfg.n_group > 1:  # every token's experts lie in topk_group of the groups
        per = ours.num_experts // ours.cfg.n_group
        assert all(len({e // per for e in row}) <= ours.cfg.topk_group for row in experts.tolist())


@pytest.mark.interpreted
@torch.inference_mode()
def test_a_model_with_the_fused_kernels_decodes_as_without(tiny_dirs, monkeypatch):
    """Kernels.moe on the tiny Qwen3-MoE: the same logits for a prefill, a decode step and a 5-token
    verify of two rows, each sparse layer through the routing and fused kernels (the decode step's
    with the post-attention norm inside the routing kernel), and the same distinct-expert counts."""
    import dataclasses

    from eaglet.kernels import EAGER
    from eaglet.models import fused_moe, moe_route

    from .test_model_parity import eaglet_step

    calls, normed = [], []
    real, route_normed = fused_moe.fused_moe, moe_route.route_normed
    monkeypatch.setattr(fused_moe, "fused_moe", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(moe_route, "route_normed", lambda *a, **kw: normed.append(1) or route_normed(*a, **kw))

    plain = load(tiny_dirs, "qwen3_moe")
    fused = load_model(tiny_dirs["qwen3_moe"][0], dtype="float32", device="cpu", tokenizer=False,
                       kernels=dataclasses.replace(EAGER, moe=True)).model
    caches = [KVCache.for_model(m.config, 2, 64, torch.float32, "cpu") for m in (plain, fused)]
    g = torch.Generator().manual_seed(4)
    for t in (9, 1, 5):
        ids = torch.randint(0, 128, (2, t), generator=g)
        a, b = (eaglet_step(m, c, ids) for m, c in zip((plain, fused), caches))
        assert (a - b).abs().max() <= 1e-5 * a.abs().max(), t
    assert len(calls) == 3 * 3  # three forwards, three sparse layers each
    assert len(normed) == 3  # the decode step's two tokens (moe.NORM_TOKENS) with the norm in the routing kernel
    counts = [[(m.touched.item(), m.forwards.item()) for m in model.modules() if isinstance(m, SparseMoE)]
              for model in (plain, fused)]
    assert counts[0] == counts[1] and counts[0][0][1] == 3  # counted in the kernels as in torch


@pytest.mark.interpreted
@torch.inference_mode()
def test_many_tokens_without_a_grouped_matmul_go_through_the_kernels_in_parts(tiny_dirs, monkeypatch):
    """Where torch's grouped matmul does not run (a float16 model, a GPU older than Hopper), a
    80-token prefill with Kernels.moe goes through the fused kernels 64 tokens at a time, with the
    logits of the plain path, and never expert by expert (a host sync, which a CUDA graph cannot take);
    with neither, the model is not capturable at all."""
    import dataclasses

    from eaglet.kernels import EAGER
    from eaglet.models import fused_moe, moe

    from .test_model_parity import eaglet_step

    calls = []
    real = fused_moe.fused_moe
    monkeypatch.setattr(fused_moe, "fused_moe", lambda x, *a, **kw: calls.append(x.shape[0]) or real(x, *a, **kw))
    plain = load(tiny_dirs, "qwen3_moe")
    fused = load_model(tiny_dirs["qwen3_moe"][0], dtype="float32", device="cpu", tokenizer=False,
                       kernels=dataclasses.replace(EAGER, moe=True)).model
    ids = torch.randint(0, 128, (1, 80), generator=torch.Generator().manual_seed(5))
    step = lambda m: eaglet_step(m, KVCache.for_model(m.config, 1, 96, torch.float32, "cpu"), ids)  # noqa: E731
    a = step(plain)  # torch's grouped matmul
    monkeypatch.setattr(moe, "has_grouped_mm", lambda x: False)
    monkeypatch.setattr(moe, "by_expert", None)  # called: a TypeError
    b = step(fused)
    assert (a - b).abs().max() <= 1e-5 * a.abs().max()
    assert calls == [64, 16] * 3  # three sparse layers
    cuda = torch.device("cuda")  # the dtype decides before the device is asked anything
    assert not moe.capturable(EAGER, torch.float16, cuda)
    assert moe.capturable(dataclasses.replace(EAGER, moe=True), torch.float16, cuda)
    assert moe.capturable(EAGER, torch.float16, torch.device("cpu"))


@pytest.mark.interpreted
@pytest.mark.parametrize("quant", ["bf16", "int4", "fp8"])
@torch.inference_mode()
def test_bench_moe_layers_and_their_checks(monkeypatch, quant):
    """bench-moe's layer (random stacks, bfloat16 or INT4 packs, copies past L2, uniform routing) and
    the checks its record carries, on a tiny shape in Triton's interpreter: the fused result near the
    grouped matmul's and each row bitwise its row computed alone; the floor counts the bytes of the
    experts touched (a quarter of bfloat16's and the scales for INT4). Float32 here: the interpreter
    does not compute bfloat16 dot products."""
    import dataclasses

    from eaglet.perf import bench_moe, shapes

    q = shapes.SHAPES["qwen3-30b-a3b"]
    monkeypatch.setitem(shapes.SHAPES, "tiny-moe", dataclasses.replace(
        q, hidden_size=64, moe=dataclasses.replace(q.moe, num_experts=16, top_k=4, expert_size=32)))
    layer = bench_moe.Layer("tiny-moe", torch.device("cpu"), [1, 8], quant, torch.float32)
    dense = 3 * 64 * 32 * 2
    assert layer.expert_bytes == {"bf16": dense, "int4": dense // 4 + 3 * 64 * 32 // 32 * 2,
                                  "fp8": dense // 2 + 2 * 4}[quant]  # fp8: one 128 x 128 block a stack here
    assert layer.copies == 8 and layer.distinct(1) == 4
    assert layer.floor_ms(8, 1e9) == layer.distinct(8) * layer.expert_bytes / 1e6
    for t in (1, 8):
        got = bench_moe.check_fused(layer, t, bench_moe.fused_moe.Tiles())
        assert got["rows_bitwise_alone"] and got["rel_err_vs_grouped"] < 0.02, (t, got)


def test_bench_moe_tiles_override_the_tuned_fields():
    """--tiles FIELD=N: those fields replace the tuned tiles of the layer's shape (the rest kept from
    moe_tiles.json), for an A/B of one field."""
    from dataclasses import replace

    from eaglet.models.fused_moe import TUNED, Tiles
    from eaglet.perf.bench_moe import layer_tiles

    tuned = TUNED["E128-H2048-I768-k8"]  # Qwen3-30B-A3B's layer, as tuned
    assert layer_tiles("qwen3-30b-a3b", "bf16", []) == tuned
    got = layer_tiles("qwen3-30b-a3b", "bf16", ["gate_cols=16", "down_warps=8", "stages=5"])
    assert got == replace(tuned, gate_cols=16, down_warps=8, stages=5) and got.down_cols == tuned.down_cols
    assert layer_tiles("qwen3-30b-a3b", "bf16", ["gate_span=48"]).spans() == (48, tuned.down_cols)  # any count
    assert tuned.down_pre == 1 and layer_tiles("qwen3-30b-a3b", "bf16", ["down_pre=0"]).down_pre == 0  # off for an A/B
    for bad in (dict(gate_cols=64, gate_span=65), dict(down_cols=32, down_span=48), dict(down_pre=3)):
        with pytest.raises(ValueError):  # tiles that would skip columns or a reduction step: refused at any source
            Tiles(**bad)


def test_bench_moe_keeps_the_copies_that_fit():
    """bench-moe's copies of a layer: enough that a replay reads past L2, as many as 60% of the free
    memory holds; Kimi-K2's 34 GB layer two on an H200 and one on an H100 (two ran it out of memory), and
    one error line on a GPU that cannot hold one."""
    from eaglet.errors import InvalidInput
    from eaglet.perf.bench_moe import L2_SAFE, copies_that_fit

    kimi, token = 384 * 88_080_384, 8 * 88_080_384  # bytes of the layer's experts and of one token's eight
    assert copies_that_fit("kimi-k2", "bf16", kimi, token, 139 * 2**30) == 2  # an H200: as many as L2 asks
    assert copies_that_fit("kimi-k2", "bf16", kimi, token, 78 * 2**30) == 1
    assert copies_that_fit("qwen3-30b-a3b", "bf16", 128 * 9_437_184, 8 * 9_437_184, 78 * 2**30) == 8
    assert copies_that_fit("tiny", "bf16", 1000, L2_SAFE // 4, None) == 4  # the CPU: as L2 asks
    with pytest.raises(InvalidInput, match=r"--shape kimi-k2: one layer's experts \(33.8 GB as bf16\) do not fit"):
        copies_that_fit("kimi-k2", "bf16", kimi, token, 30 * 2**30)


@pytest.mark.parametrize("flags, said", [
    (["--tokens", "65"], "--tokens 65: must be 1 to 64"),
    (["--tokens", "1", "4", "--tune", "--tune-tokens", "16"], "--tune-tokens 16: not among --tokens 1 4"),
    (["--shape", "llama-3.1-8b"], "--shape llama-3.1-8b: not an MoE shape"),
    (["--tiles", "gate_rows=32"], "--tiles gate_rows=32: no tile field 'gate_rows'"),
    (["--tiles", "gate_cols=0"], "--tiles gate_cols=0: the value must be an integer of at least 1"),
    (["--tiles", "gate_cols=48"], "--tiles gate_cols=48: gate_cols must be a power of two"),
    (["--tiles", "gate_cols=32", "--tune"], "--tiles with --tune"),
    (["--shape", "qwen3-30b-a3b", "--tiles", "gate_span=65"], "--tiles: gate_span 65 exceeds gate_cols 64"),
    (["--tiles", "down_pre=3"], "--tiles: down_pre 3: 0, 1 or 2"),
    (["--tiles", "gate_span=0"], "--tiles gate_span=0: the value must be an integer of at least 1"),
])
def test_bench_moe_bad_input_is_one_error_line(flags, said, capsys, tmp_path):
    from eaglet.cli import main

    assert main(["bench-moe", "--out", str(tmp_path), *flags]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("eaglet: error:") and said in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())
