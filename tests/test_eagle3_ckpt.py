"""EAGLE-3 drafter checkpoints (reference/eagle3.md): eaglet's own save/load round trip; foreign
checkpoints written here by hand from the documented formats (SGLang/SpecForge, the EAGLE reference,
vLLM's speculators, an own embedding, pytorch_model.bin), each loaded and run in lossless greedy
speculation on a tiny target; and drafters that do not fit the target, refused with a named reason."""
import dataclasses
import json
import re

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from eaglet.config import SpecConfig
from eaglet.errors import ModelLoadError
from eaglet.generate import GenerationConfig, Generator
from eaglet.kvcache import KVCache
from eaglet.models.attention import AttnMeta
from eaglet.spec.drafters.eagle3_ckpt import load_eagle3, save_eagle3
from eaglet.spec.drafters.eagle3_head import Eagle3Config, Eagle3Head
from eaglet.spec.speculator import Speculator
from eaglet.weights import load_model

VD = 40  # draft vocabulary: a random sorted subset of the tiny target's 128 ids
GREEDY = GenerationConfig(max_new_tokens=16, ignore_eos=True)
PROMPTS = [torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 9, 3)]
SGLANG_IDS = [0, 1, 2]  # SGLang convention: outputs of layers 0..2, i.e. eaglet's inputs of 1..3


@pytest.fixture(scope="module")
def target(tiny_dirs):
    return load_model(tiny_dirs["llama3"][0], dtype="float32", device="cpu", tokenizer=False).model


@pytest.fixture(scope="module")
def plain(target):
    return [c.tokens for c in Generator(target, None).generate(PROMPTS, GREEDY)]


def random_head(cfg: Eagle3Config, seed: int = 0) -> Eagle3Head:
    g = torch.Generator().manual_seed(seed)
    head = Eagle3Head(cfg)
    with torch.no_grad():
        for name, p in head.named_parameters():
            r = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * r if name.endswith("norm.weight") else 0.1 * r)
    if cfg.draft_vocab_size < cfg.layer.vocab_size:
        head.set_vocab(torch.randperm(cfg.layer.vocab_size, generator=g)[: cfg.draft_vocab_size].sort().values)
    return head.eval()


def run_head(head: Eagle3Head, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The head over one sequence (1, T, H) from an empty cache, as Eagle3Drafter.catch_up runs it."""
    c, t = head.cfg.layer, emb.shape[1]
    cache = KVCache(c.num_layers, 1, c.num_kv_heads, t, c.head_dim, emb.dtype, "cpu")
    positions = torch.arange(t)[None]
    with torch.inference_mode():
        return head(emb, hidden, positions, cache, AttnMeta.build(cache.lens, positions, cache.kv_len(t)))


def drafts(head, target) -> list[tuple[int, int]]:
    """(drafts, accepted tokens) of each prompt, speculating with `head` at chain 3: equal lists mean the
    same drafts accepted at every step."""
    spec = Speculator(SpecConfig("eagle3", steps=3), head=head)
    return [(c.spec.drafts, c.spec.accepted_tokens) for c in Generator(target, None, spec).generate(PROMPTS, GREEDY)]


def head_logits(head: Eagle3Head, target, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids, taps = torch.randint(0, 128, (1, 7), generator=g), torch.randn(1, 7, 3 * 64, generator=g)
    p = next(head.parameters())
    with torch.inference_mode():
        emb = F.embedding(ids, target.model.embed_tokens.weight).to(p.dtype)
        return head.logits(run_head(head, emb, head.fc(taps.to(p.dtype))))


# ---- round trip ---------------------------------------------------------------------------------

@pytest.mark.parametrize("aux, nbr", [(None, False), ((1, 2, 3), True)])
def test_round_trip(target, tmp_path, aux, nbr):
    cfg = Eagle3Config.for_target(target.config, draft_vocab_size=VD)
    head = random_head(dataclasses.replace(cfg, aux_layers=aux or cfg.aux_layers, norm_before_residual=nbr))
    out = save_eagle3(head, tmp_path / "h", dtype=torch.float32)

    hf = json.loads((out / "config.json").read_text())  # the SGLang format
    assert hf["architectures"] == ["LlamaForCausalLMEagle3"] and hf["num_hidden_layers"] == 1
    assert (hf["vocab_size"], hf["draft_vocab_size"]) == (128, VD)
    assert hf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in head.cfg.aux_layers]
    saved = load_file(str(out / "model.safetensors"))
    assert set(saved) == set(head.state_dict()) and "embed_tokens.weight" not in saved
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o644  # readable by the server that loads it
    assert saved["d2t"].dtype == torch.int64 and saved["t2d"].dtype == torch.bool
    assert int(saved["t2d"].sum()) == VD and saved["t2d"].shape == (128,)

    loaded, embed = load_eagle3(out, target.config, "cpu", torch.float32)
    assert embed is None
    assert loaded.cfg == head.cfg  # aux layers back through the SGLang -1/+1 convention
    for k, v in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    assert torch.equal(loaded.draft_to_target(), head.draft_to_target())
    assert torch.equal(head_logits(loaded, target), head_logits(head, target))


def test_bf16_save_is_smaller_and_loads(target, tmp_path):
    head = random_head(Eagle3Config.for_target(target.config, draft_vocab_size=VD))
    f32 = save_eagle3(head, tmp_path / "f32", dtype=torch.float32)
    b16 = save_eagle3(head, tmp_path / "b16")  # the default dtype
    size = lambda d: (d / "model.safetensors").stat().st_size  # noqa: E731
    assert size(b16) < 0.6 * size(f32)
    assert json.loads((b16 / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded, _ = load_eagle3(b16, target.config, "cpu", torch.bfloat16)
    assert loaded.fc.weight.dtype == torch.bfloat16
    assert loaded.d2t.dtype == torch.int64 and loaded.t2d.dtype == torch.bool  # the maps are not cast
    assert torch.equal(loaded.lm_head.weight, head.lm_head.weight.bfloat16())
    assert torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.t2d, head.t2d)
    want = head_logits(head, target)
    assert (head_logits(loaded, target).float() - want).abs().max() < 0.05 * want.abs().max()


# ---- foreign checkpoints, written from the documented formats -----------------------------------

def llama_layer_config(c: Eagle3Config) -> dict:
    lc = c.layer
    return {"model_type": "llama", "num_hidden_layers": 1, "hidden_size": lc.hidden_size,
            "intermediate_size": lc.intermediate_size, "num_attention_heads": lc.num_heads,
            "num_key_value_heads": lc.num_kv_heads, "rms_norm_eps": lc.rms_norm_eps, "rope_theta": lc.rope.theta,
            "max_position_embeddings": 2048, "vocab_size": lc.vocab_size, "tie_word_embeddings": False}


def sglang_config(c: Eagle3Config, arch: str = "LlamaForCausalLMEagle3", eagle_ids=SGLANG_IDS) -> dict:
    cfg = {"architectures": [arch], **llama_layer_config(c), "draft_vocab_size": c.draft_vocab_size,
           "torch_dtype": "float32"}
    if c.target_hidden_size != c.layer.hidden_size:
        cfg["target_hidden_size"] = c.target_hidden_size
    if eagle_ids is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": eagle_ids, "use_aux_hidden_state": True}
    return cfg


def speculators_config(c: Eagle3Config, nbr: bool | None) -> dict:
    cfg = {"architectures": ["Eagle3Speculator"], "model_type": "speculators", "speculators_model_type": "eagle3",
           "draft_vocab_size": c.draft_vocab_size, "target_hidden_size": None,
           "eagle_aux_hidden_state_layer_ids": [1, 2, 3],  # inputs of layers, used as-is
           "transformer_layer_config": {**llama_layer_config(c), "architectures": ["LlamaForCausalLM"]},
           "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                  "verifier": {"name_or_path": "tiny", "architectures": ["LlamaForCausalLM"]}}}
    if nbr is not None:
        cfg["norm_before_residual"] = nbr
    return cfg


def write_foreign(kind: str, d, t, nbr: bool | None = True):
    """A drafter directory of `kind` for target config `t`; returns (the head it holds, its embedding)."""
    base = Eagle3Config.for_target(t, draft_vocab_size=VD)
    if kind == "own_embed":  # narrower than the target: only possible with an embedding of its own
        base = dataclasses.replace(base, layer=base.layer.replace(hidden_size=32, intermediate_size=48,
                                                                 num_heads=2, num_kv_heads=1))
    ref = random_head(dataclasses.replace(base, aux_layers=base.aux_layers if kind == "eagle_reference" else (1, 2, 3),
                                          norm_before_residual=kind == "speculators" and bool(nbr)))
    tensors = {k: v.contiguous() for k, v in ref.state_dict().items()}
    embed = None
    if kind == "speculators":
        cfg = speculators_config(ref.cfg, nbr)
        tensors = {k.replace("midlayer.", "layers.0.").replace("d2t", "draft_id_to_target_id"): v
                   for k, v in tensors.items()}
    elif kind == "eagle_reference":
        cfg = sglang_config(ref.cfg, arch="LlamaForCausalLM", eagle_ids=None)
    else:
        cfg = sglang_config(ref.cfg)
    if kind == "own_embed":
        embed = tensors["embed_tokens.weight"] = 0.5 * torch.randn(t.vocab_size, 32)
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    if kind == "bin":
        torch.save(tensors, d / "pytorch_model.bin")
    else:
        save_file(tensors, str(d / "model.safetensors"))
    return ref, embed


@pytest.mark.parametrize("kind, aux", [("sglang", (1, 2, 3)), ("eagle_reference", (2, 2, 1)),  # 2, N//2, N-3
                                       ("speculators", (1, 2, 3)), ("own_embed", (1, 2, 3)), ("bin", (1, 2, 3))])
def test_foreign_checkpoint_loads_and_runs(target, plain, tmp_path, kind, aux):
    ref, ref_embed = write_foreign(kind, tmp_path / "d", target.config)
    head, embed = load_eagle3(tmp_path / "d", target.config, "cpu", torch.float32)
    assert head.cfg.aux_layers == aux and head.cfg.draft_vocab_size == VD
    assert head.cfg.norm_before_residual == (kind == "speculators")
    for k, v in ref.state_dict().items():
        assert torch.equal(head.state_dict()[k], v), k
    assert (embed is None and ref_embed is None) or torch.equal(embed, ref_embed)
    x, h = torch.randn(1, 5, head.cfg.layer.hidden_size), torch.randn(1, 5, head.cfg.layer.hidden_size)
    assert torch.equal(run_head(head, x, h), run_head(ref, x, h))  # same config read back: same computation

    spec = Speculator(SpecConfig("eagle3", steps=3), head=head, head_embed=embed)
    out = Generator(target, None, spec).generate(PROMPTS, GREEDY)
    assert [c.tokens for c in out] == plain  # lossless
    assert all(c.spec.drafts > 0 and c.spec.draft_tokens == 3 * c.spec.drafts for c in out)


@pytest.mark.parametrize("form", ["eaglet", "speculators"])
def test_a_head_without_lm_head_drafts_through_the_targets(target, plain, tmp_path, form):
    """A checkpoint without lm_head.weight (SGLang: no draft_vocab_size; vLLM: no lm_head) drafts over the
    whole vocabulary through the target's output layer: eaglet writes it so, loads it sharing the
    target's tensor, and speculates losslessly with it; without the target's layer it is refused."""
    own = random_head(Eagle3Config.for_target(target.config))
    head = own.with_shared_lm_head(target.lm_head.weight)
    assert head.cfg.shared_lm_head and head.cfg.draft_vocab_size == 128 and bool(head.t2d.all())
    for k, v in own.state_dict().items():
        if k not in ("lm_head.weight", "d2t", "t2d"):
            assert torch.equal(head.state_dict()[k], v), k
    out = save_eagle3(head, tmp_path / "h", dtype=torch.float32)
    hf = json.loads((out / "config.json").read_text())
    saved = load_file(str(out / "model.safetensors"))
    assert "draft_vocab_size" not in hf and hf["vocab_size"] == 128
    assert not {"lm_head.weight", "d2t", "t2d"} & set(saved) and "fc.weight" in saved
    if form == "speculators":  # vLLM's speculators layout of the same weights
        (out / "config.json").write_text(json.dumps({**speculators_config(head.cfg, None), "draft_vocab_size": 128}))
        save_file({k.replace("midlayer.", "layers.0."): v for k, v in saved.items()}, str(out / "model.safetensors"))

    loaded, _ = load_eagle3(out, target.config, "cpu", torch.float32, target.lm_head.weight)
    assert loaded.cfg.shared_lm_head and loaded.cfg.draft_vocab_size == 128
    assert loaded.lm_head.weight.data_ptr() == target.lm_head.weight.data_ptr()  # the target's tensor, no copy
    assert torch.equal(head_logits(loaded, target), head_logits(head, target))
    spec = Speculator(SpecConfig("eagle3", steps=3), head=loaded)
    outs = Generator(target, None, spec).generate(PROMPTS, GREEDY)
    assert [c.tokens for c in outs] == plain  # lossless
    with pytest.raises(ModelLoadError, match="drafts through the target's output layer, and none was given"):
        load_eagle3(out, target.config, "cpu", torch.float32)


def reference_one_position(head: Eagle3Head, emb, h, nbr: bool) -> torch.Tensor:
    """The midlayer at a single position from reference/eagle3.md alone: attention over one key is
    its value, so RoPE drops out. Residual from h, or from hidden_norm(h) when norm_before_residual."""
    m, c = head.midlayer, head.cfg.layer
    rms = lambda x, w: w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps)  # noqa: E731
    hn = rms(h, m.hidden_norm.weight)
    x = torch.cat([rms(emb, m.input_layernorm.weight), hn], -1)
    v = F.linear(x, m.self_attn.v_proj.weight).view(c.num_kv_heads, c.head_dim)
    v = v.repeat_interleave(c.num_heads // c.num_kv_heads, 0).flatten()  # GQA: kv head shared by its group
    out = (hn if nbr else h) + F.linear(v, m.self_attn.o_proj.weight)
    y = rms(out, m.post_attention_layernorm.weight)
    return out + m.mlp.down_proj(F.silu(m.mlp.gate_proj(y)) * m.mlp.up_proj(y))


@pytest.mark.parametrize("nbr", [True, False, None])  # None: key absent, vLLM's default False
def test_speculators_norm_before_residual(target, tmp_path, nbr):
    write_foreign("speculators", tmp_path / "d", target.config, nbr=nbr)
    head, _ = load_eagle3(tmp_path / "d", target.config, "cpu", torch.float32)
    assert head.cfg.norm_before_residual is bool(nbr)
    g = torch.Generator().manual_seed(3)
    emb, h = torch.randn(64, generator=g), 4 * torch.randn(64, generator=g)  # |h| far from 1: the norm matters
    got = run_head(head, emb[None, None], h[None, None])[0, 0]
    with torch.no_grad():
        assert torch.allclose(got, reference_one_position(head, emb, h, bool(nbr)), atol=1e-5)
        assert (got - reference_one_position(head, emb, h, not nbr)).abs().max() > 0.5


# ---- heads of several layers (vLLM's layers.1, layers.2, ...) -----------------------------------

def reference_later_layer(layer, x, c) -> torch.Tensor:
    """vLLM's later EAGLE-3 layer at a single position, from its description alone: a pre-norm Llama
    decoder layer on the residual stream x (attention over one key is its value)."""
    rms = lambda v, w: w * v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps)  # noqa: E731
    v = F.linear(rms(x, layer.input_layernorm.weight), layer.self_attn.v_proj.weight).view(c.num_kv_heads, c.head_dim)
    x = x + F.linear(v.repeat_interleave(c.num_heads // c.num_kv_heads, 0).flatten(), layer.self_attn.o_proj.weight)
    y = rms(x, layer.post_attention_layernorm.weight)
    return x + layer.mlp.down_proj(F.silu(layer.mlp.gate_proj(y)) * layer.mlp.up_proj(y))


@pytest.mark.parametrize("form", ["eaglet", "vllm"])
def test_a_two_layer_head_round_trips_and_speculates_losslessly(target, plain, tmp_path, form):
    """A head of two layers: written with num_hidden_layers 2 and its second layer as vLLM names it
    (layers.1.*, q/k/v reading H, not 2H), loaded back from that or from vLLM's own naming (layers.0.*
    for the midlayer), computing what vLLM's description says, and drafting losslessly."""
    head = random_head(Eagle3Config.for_target(target.config, draft_vocab_size=VD, num_layers=2))
    out = save_eagle3(head, tmp_path / "h", dtype=torch.float32)
    hf = json.loads((out / "config.json").read_text())
    saved = load_file(str(out / "model.safetensors"))
    assert hf["num_hidden_layers"] == 2 and set(saved) == set(head.state_dict())
    c = head.cfg.layer
    assert saved["layers.1.self_attn.q_proj.weight"].shape == (c.num_heads * c.head_dim, c.hidden_size)
    assert saved["midlayer.self_attn.q_proj.weight"].shape == (c.num_heads * c.head_dim, 2 * c.hidden_size)
    if form == "vllm":
        save_file({("model." + k.replace("midlayer.", "layers.0.") if k.startswith(("midlayer.", "layers.")) else k): v
                   for k, v in saved.items()}, str(out / "model.safetensors"))
    loaded, _ = load_eagle3(out, target.config, "cpu", torch.float32)
    assert loaded.cfg == head.cfg and loaded.cfg.layer.num_layers == 2
    for k, v in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    g = torch.Generator().manual_seed(3)
    emb, h = torch.randn(64, generator=g), 4 * torch.randn(64, generator=g)
    with torch.no_grad():
        want = reference_later_layer(loaded.layers["1"], reference_one_position(loaded, emb, h, False), c)
        assert torch.allclose(run_head(loaded, emb[None, None], h[None, None])[0, 0], want, atol=1e-5)
    spec = Speculator(SpecConfig("eagle3", steps=3), head=loaded)
    outs = Generator(target, None, spec).generate(PROMPTS, GREEDY)
    assert [c.tokens for c in outs] == plain  # lossless
    assert all(c.spec.drafts > 0 for c in outs)


@pytest.mark.parametrize("case", ["config says 1", "gap"])
def test_a_head_whose_layers_do_not_add_up_is_refused(target, tmp_path, case):
    head = random_head(Eagle3Config.for_target(target.config, draft_vocab_size=VD, num_layers=2))
    out = save_eagle3(head, tmp_path / "h", dtype=torch.float32)
    if case == "config says 1":
        hf = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**hf, "num_hidden_layers": 1}))
        says = "config.json says num_hidden_layers 1, the weights hold 2 layers"
    else:
        saved = load_file(str(out / "model.safetensors"))
        save_file({k.replace("layers.1.", "layers.2."): v for k, v in saved.items()}, str(out / "model.safetensors"))
        says = "later layers are numbered [2], not 1..1"
    with pytest.raises(ModelLoadError, match=re.escape(says)):
        load_eagle3(out, target.config, "cpu", torch.float32)


# ---- drafters that do not fit the target --------------------------------------------------------

BAD_DRAFTERS = {  # name -> (config.json changes, tensor to drop, what the error must say)
    "target hidden size": ({"target_hidden_size": 32}, None, "target hidden size 32, the target has 64"),
    "vocabulary": ({"vocab_size": 256}, None, "vocabulary 256 does not match the target's 128"),
    "taps": ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 4]}}, None,
             "taps target layers [2, 3, 5], but the target has 4 layers"),
    "architecture": ({"architectures": ["MedusaModel"]}, None, "unknown EAGLE-3 drafter architecture 'MedusaModel'"),
    "tensor": ({}, "midlayer.mlp.up_proj.weight", "missing tensor 'midlayer.mlp.up_proj.weight'"),
    "vocab map": ({}, "d2t", "missing tensor 'd2t'"),
    "no embedding": ({}, "embed_tokens.weight", "hidden size 32 differs from the target's 64"),
    "no lm_head, a draft vocabulary": ({}, "lm_head.weight", "no lm_head.weight, yet a draft vocabulary of 40 ids"),
}


def write_bad_drafter(name: str, d, t) -> str:
    """A broken SGLang drafter directory for target config `t`; returns what the error must say."""
    changes, drop, says = BAD_DRAFTERS[name]
    write_foreign("own_embed" if drop == "embed_tokens.weight" else "sglang", d, t)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **changes}))
    tensors = load_file(str(d / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k != drop}, str(d / "model.safetensors"))
    return says


@pytest.mark.parametrize("name", BAD_DRAFTERS)
def test_bad_drafter_is_refused(target, tmp_path, name):
    says = write_bad_drafter(name, tmp_path / "d", target.config)
    with pytest.raises(ModelLoadError) as e:
        load_eagle3(tmp_path / "d", target.config, "cpu", torch.float32)
    assert says in str(e.value)


def test_capture_keeps_order_and_repeats(target):
    """A 4-layer target's default taps are (2, 2, 1): the model must return them in that order, repeats kept."""
    ids, pos = torch.tensor([[5, 6, 7]]), torch.arange(3)[None]
    meta = lambda c: AttnMeta.build(c.lens, pos, 3)  # noqa: E731
    with torch.inference_mode():
        c1, c2 = (KVCache.for_model(target.config, 1, 3, torch.float32, "cpu") for _ in range(2))
        _, one = target(ids, pos, c1, meta(c1), capture=(1, 2))
        _, aux = target(ids, pos, c2, meta(c2), capture=(2, 2, 1))
    assert torch.equal(aux, torch.cat([one[..., 64:], one[..., 64:], one[..., :64]], -1))


@torch.inference_mode()
@pytest.mark.parametrize("nbr, layers", [(False, 1), (True, 1), (False, 2)])
def test_head_step_is_logits_of_forward(target, nbr, layers):
    """Eagle3Head.step (the last residual add inside the final norm) gives forward's output and
    logits(forward) exactly."""
    from eaglet.models.attention import AttnMeta

    cfg = Eagle3Config.for_target(target.config, draft_vocab_size=VD, num_layers=layers)
    head = random_head(dataclasses.replace(cfg, norm_before_residual=nbr))
    g = torch.Generator().manual_seed(0)
    h_size = cfg.layer.hidden_size
    emb, hid = torch.randn(2, 3, h_size, generator=g), torch.randn(2, 3, h_size, generator=g)
    pos = torch.arange(3).expand(2, 3)
    runs = []
    for use_step in (False, True):
        cache = KVCache.for_model(cfg.layer, 2, 8, torch.float32, torch.device("cpu"))
        meta = AttnMeta.build(cache.lens, pos, 3)
        runs.append(head.step(emb, hid, pos, cache, meta) if use_step else head(emb, hid, pos, cache, meta))
    h, (logits, h2) = runs
    assert torch.equal(h2, h) and torch.equal(logits, head.logits(h))
