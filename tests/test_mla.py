"""Multi-head Latent Attention (models/mla.py; its logits against transformers' DeepSeek-V2/V3 are in
test_model_parity): the absorbed form against the expanded one, the latent cache's size at
DeepSeek-V3's dimensions, Kimi-K2's config, and greedy speculation on an MLA target."""
import pytest
import torch

from eaglet import GenerationConfig, Generator, load_model
from eaglet.config import MLAConfig, ModelConfig, SpecConfig
from eaglet.kvcache import KVCache
from eaglet.models.mla import attend_absorbed, attend_expanded

from .test_model_parity import eaglet_step
from .test_spec_greedy import SHAPES, Recording, random_head, recording, run_checked, small_draft  # noqa: F401

DEEPSEEK_V3 = dict(model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                   moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
                   num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                   qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, num_experts_per_tok=8,
                   n_shared_experts=1, n_group=8, topk_group=4, first_k_dense_replace=3,
                   routed_scaling_factor=2.5, norm_topk_prob=True, topk_method="noaux_tc",
                   max_position_embeddings=163840, rope_theta=10000, rope_scaling=dict(
                       type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                       mscale=1.0, mscale_all_dim=1.0))


@pytest.mark.parametrize("t", [1, 5])
@torch.inference_mode()
def test_absorbed_equals_expanded(t):
    """Attention in the latent space (kv_b_proj folded into the query and the output) equals the
    expanded keys and values, for a decode step and a 5-token verify over 40 cached latents."""
    m = MLAConfig(None, 32, 16, 8, 12)
    g = torch.Generator().manual_seed(0)
    b, nh, s = 2, 4, 40
    q_nope, q_pe = torch.randn(b, t, nh, 16, generator=g), torch.randn(b, t, nh, 8, generator=g)
    latent = torch.randn(b, s, m.width, generator=g)
    w_kv = torch.randn(nh * (16 + 12), 32, generator=g) / 6
    mask = torch.zeros(b, 1, t, s)
    mask[0, :, :, 30:] = float("-inf")  # row 0 holds 30 tokens
    mask[:, :, 0, s - t + 1:] = float("-inf")  # causal within the new block
    a = attend_absorbed(q_nope, q_pe, latent, mask, w_kv, m, 0.2)
    e = attend_expanded(q_nope, q_pe, latent, mask, w_kv, m, 0.2)
    assert a.shape == (b, t, nh, 12) and (a - e).abs().max() <= 1e-5 * e.abs().max()


def test_latent_cache_holds_576_values_a_token_and_layer():
    """DeepSeek-V3's (and Kimi-K2's) dimensions: 512 latent + 64 rotary values per token and layer,
    against 2 x 128 heads x 192 for the expanded keys and values."""
    cfg = ModelConfig.from_hf(DEEPSEEK_V3)
    assert cfg.mla.width == 576 and cfg.head_dim == 64 and cfg.moe.dense_layers == (0, 1, 2)
    assert cfg.rope.kind == "yarn" and cfg.rope.factor == 40 and ModelConfig.from_hf(cfg.to_hf()) == cfg
    cache = KVCache.for_model(cfg.replace(num_layers=2), 3, 16, torch.bfloat16, "meta")
    assert tuple(cache.kv.shape) == (2, 1, 3, 1, 16, 576)  # layers, one part, rows, one head, slots, values
    assert cache.kv[0].numel() // (3 * 16) == 576


def test_kimi_k2_config_loads_as_deepseek_v3():
    kimi = ModelConfig.from_hf(dict(DEEPSEEK_V3, model_type="kimi_k2", vocab_size=163840, n_routed_experts=384,
                                    num_attention_heads=64, num_key_value_heads=64, n_group=1, topk_group=1))
    assert kimi.model_type == "deepseek_v3" and kimi.moe.num_experts == 384 and kimi.mla.width == 576
    assert kimi.moe.scoring == "sigmoid" and kimi.moe.score_bias and kimi.moe.scaling == 2.5
    assert ModelConfig.from_hf(kimi.to_hf()) == kimi


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
@torch.inference_mode()
def test_the_input_projections_are_one_matmul(tiny_dirs, family):
    """A loaded MLA model projects its layer input once for q (V2-Lite) or q_a (V3) and kv_a: the two
    weights are views of one tensor under their checkpoint names, and the forward of a layer equals
    the two matmuls apart (their parity with transformers is test_model_parity's)."""
    model = load_model(tiny_dirs[family][0], dtype="float32", device="cpu", tokenizer=False).model
    attn = model.model.layers[0].self_attn
    first = attn.q_proj if attn.mla.q_lora_rank is None else attn.q_a_proj
    assert attn.fused == first.weight.shape[0]
    assert first.weight.data_ptr() == attn.input_weight.data_ptr()
    assert attn.kv_a_proj_with_mqa.weight.data_ptr() == attn.input_weight[attn.fused:].data_ptr()
    keys = model.state_dict().keys()
    assert not any("input_weight" in k for k in keys) and any(k.endswith("kv_a_proj_with_mqa.weight") for k in keys)
    x = torch.randn(2, 3, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    q, kv = attn.project(x)
    attn.fused = 0  # the modules one by one
    q2, kv2 = attn.project(x)
    torch.testing.assert_close(q, q2)
    torch.testing.assert_close(kv, kv2)


@pytest.fixture(scope="module")
def mla_target(tiny_dirs):
    """(the tiny DeepSeek-V3 target, 20 prompts, their plain greedy output)."""
    model = load_model(tiny_dirs["deepseek_v3"][0], dtype="float32", device="cpu", tokenizer=False).model
    prompts = [torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(s)).tolist()
               for s, n in enumerate([3, 5, 8, 13, 1, 20, 7, 9, 11, 4, 6, 2, 15, 10, 12, 17, 3, 8, 5, 19])]
    greedy = GenerationConfig(max_new_tokens=64, ignore_eos=True)
    # one batch (float32: its rows decode as each would alone, test_spec_greedy's batch test)
    return model, prompts, [c.tokens for c in Generator(model, None).generate(prompts, greedy)]


@pytest.mark.parametrize("shape", ["chain3", "tree3x3"])
@pytest.mark.parametrize("drafter", ["eagle3", "ngram", "draft"])
def test_speculation_on_an_mla_target_equals_plain_greedy(mla_target, small_draft, drafter, shape):
    """The latent cache through prefill (expanded), verify (absorbed, a tree's mask) and the
    acceptance's moves of accepted entries: plain greedy token for token, every step replayed."""
    model, prompts, ref = mla_target
    outs, _ = run_checked(model, prompts, ref, recording(drafter, SpecConfig(drafter, **SHAPES[shape]), model, small_draft))
    assert sum(c.spec.accepted_tokens for c in outs) > 0


@torch.inference_mode()
def test_yarn_rope_of_deepseek_matches_transformers(tmp_path):
    """YaRN as DeepSeek-V3 and Kimi-K2 ship it (factor 40 over 4,096 pretrained positions there; 4
    over 32 here, mscale and mscale_all_dim 1): the blended frequencies, cos and sin scaled, the
    softmax scale times mscale_all_dim's factor squared; prefill and decode logits equal transformers'."""
    from .conftest import hf_model

    ref = hf_model("deepseek_v3", max_position_embeddings=128, rope_scaling=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=32, beta_fast=32, beta_slow=1, mscale=1.0,
        mscale_all_dim=1.0))
    ref.save_pretrained(tmp_path)
    model = load_model(tmp_path, dtype="float32", device="cpu", tokenizer=False).model
    assert model.config.rope.kind == "yarn" and model.config.rope.softmax_scale() > 1
    cache = KVCache.for_model(model.config, 1, 128, torch.float32, "cpu")
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))  # past the 32 pretrained
    out = ref(ids, use_cache=True)
    assert (eaglet_step(model, cache, ids) - out.logits).abs().max() <= 1e-4
    tok = out.logits[:, -1].argmax(-1, keepdim=True)
    out = ref(tok, past_key_values=out.past_key_values, use_cache=True)
    assert (eaglet_step(model, cache, tok) - out.logits).abs().max() <= 1e-4


def test_training_a_drafter_on_an_moe_mla_target_lowers_the_loss(mla_target, tmp_path):
    """train-draft's trainer with the tiny DeepSeek-V3 as its frozen target (taps of MLA layers with
    routed and shared experts, causal over whole rows): 30 steps lower the loss."""
    import json

    from .test_train import config, make_trainer

    model, _, _ = mla_target
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 128, (8,), generator=g).tolist() for _ in range(48)]
    outs = Generator(model, None).generate(prompts, GenerationConfig(max_new_tokens=24, ignore_eos=True))
    rows = [{"id": str(i), "input_ids": p + o.tokens, "prompt_len": 8} for i, (p, o) in enumerate(zip(prompts, outs))]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "shard-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tr = make_trainer(config(tmp_path / "data", tmp_path / "out", max_steps=30), model)
    tr.train()
    losses = [h["loss"] for h in tr.history]
    # the soft cross-entropy falls toward the target's own entropy (~10 here): 10.4 -> 10.0
    assert len(losses) == 30 and sum(losses[:5]) / 5 - sum(losses[-5:]) / 5 > 0.25, losses


def test_an_eagle3_drafter_with_its_own_embedding_drafts_for_an_mla_target(mla_target, tmp_path):
    """A drafter in SGLang's format made for a DeepSeek-architecture target (as the published
    Kimi-K2 ones: its own embedding table, a draft vocabulary smaller than the target's) loads
    against the target's config and speculates: plain greedy token for token."""
    from eaglet.spec.drafters.eagle3_ckpt import load_eagle3, save_eagle3

    model, prompts, ref = mla_target
    own = 0.05 * torch.randn(128, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    save_eagle3(random_head(model.config, torch.arange(0, 128, 4)), tmp_path / "drafter", torch.float32, embed=own)
    head, embed = load_eagle3(tmp_path / "drafter", model.config, "cpu", torch.float32)
    assert torch.equal(embed, own) and head.cfg.draft_vocab_size == 32
    sp = Recording(SpecConfig("eagle3", steps=3, topk=2, draft_tokens=6), head=head, head_embed=embed)
    run_checked(model, prompts[:8], ref[:8], sp)


@torch.inference_mode()
def test_a_multimodal_wrapper_loads_its_language_model(tiny_dirs, tmp_path):
    """Kimi-K2.5's layout: the text model's config as `text_config` (model_type kimi_k2) inside the
    wrapper's, its weights under `language_model.`, a vision tower beside; eaglet loads the language
    model alone, the same as the plain checkpoint."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    src = tiny_dirs["deepseek_v3"][0]
    text = json.loads((src / "config.json").read_text())
    wrapper = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
               "text_config": {**text, "model_type": "kimi_k2"}, "vision_config": {"hidden_size": 8}}
    (tmp_path / "config.json").write_text(json.dumps(wrapper))
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        state = {"language_model." + k: f.get_tensor(k) for k in f.keys()}
    save_file({**state, "vision_tower.patch_embed.weight": torch.zeros(8, 3)}, str(tmp_path / "model.safetensors"))
    got = load_model(tmp_path, dtype="float32", device="cpu", tokenizer=False).model
    want = load_model(src, dtype="float32", device="cpu", tokenizer=False).model
    assert got.config == want.config
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    logits = []
    for m in (got, want):
        cache = KVCache.for_model(m.config, 1, 16, torch.float32, "cpu")
        logits.append(eaglet_step(m, cache, ids))
    assert torch.equal(*logits)
