"""GGUF files (llama.cpp) through eaglet's real loader: tiny random transformers models are written
the way llama.cpp's convert_hf_to_gguf.py writes them (metadata keys, tensor names, Q/K row
permutation for the llama arch, F32 norms), as F32, Q8_0 and Q4_1, then loaded with `load_model`
and compared with the source weights and with transformers' logits. Also: the converted-weights
cache, and the errors for unsupported or broken files."""
import copy
import re

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import ExpertGatingFuncType, GGUFReader, GGUFWriter, quants

from eaglet.errors import ModelLoadError
from eaglet.kvcache import KVCache
from eaglet.weights import load_model
from eaglet.weights.gguf_file import GGUFFile
from eaglet.weights.names import hf_to_gguf, permute_qk, unpermute_qk

from .conftest import hf_model
from .test_model_parity import eaglet_step

TOL = 1e-4
LLAMA_CPP_KEYS = ["general.architecture", "llama.block_count", "llama.context_length",
                  "llama.embedding_length", "llama.feed_forward_length", "llama.attention.head_count",
                  "llama.attention.head_count_kv", "llama.rope.freq_base",
                  "llama.attention.layer_norm_rms_epsilon", "llama.vocab_size"]


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, written out independently of eaglet."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_cpp_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of `llama_cpp_permute`, by inverting its row index (independent of eaglet)."""
    return w[np.argsort(llama_cpp_permute(np.arange(w.shape[0]), n_head))]


def qk_heads(name: str, cfg) -> int | None:
    if ".q_proj." in name:
        return cfg.num_attention_heads
    if ".k_proj." in name:
        return cfg.num_key_value_heads
    return None


def writer(path, arch: str, cfg) -> GGUFWriter:
    """A GGUF writer for `arch` with the hyper-parameters every architecture here has."""
    w = GGUFWriter(str(path), arch)  # writes general.architecture
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_theta if hasattr(cfg, "rope_theta") else cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    return w


def write_gguf(path, model, qtype=Q.F32, arch="llama", extra=()) -> dict[str, np.ndarray]:
    """Write `model` as llama.cpp's converter would: 2-D weights as `qtype`, everything else F32, no
    output.weight when embeddings are tied. `extra` is (GGUF name, array) pairs appended at the end.
    Returns {HF name: the float32 weight eaglet should load} (dequantized, un-permuted)."""
    cfg = model.config
    w = writer(path, arch, cfg)
    w.add_feed_forward_length(cfg.intermediate_size)
    expected = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        arr = t.numpy()
        heads = qk_heads(name, cfg) if arch == "llama" else None
        if heads:
            arr = llama_cpp_permute(arr, heads)
        if arr.ndim == 2 and qtype != Q.F32:
            data = quants.quantize(arr, qtype)  # uint8 (rows, bytes per row); the writer derives the shape
            w.add_tensor(hf_to_gguf(name), data, raw_dtype=qtype)
            stored = quants.dequantize(data, qtype)
        else:
            w.add_tensor(hf_to_gguf(name), arr)
            stored = arr
        expected[name] = llama_cpp_unpermute(stored, heads) if heads else stored
    for gname, arr in extra:
        w.add_tensor(gname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def load(path):
    return load_model(path, dtype="float32", device="cpu", tokenizer=False)


def with_weights(model, weights: dict[str, np.ndarray]):
    """A copy of the transformers model holding `weights` (e.g. dequantized ones)."""
    ref = copy.deepcopy(model)
    ref.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in weights.items()})
    return ref


@torch.inference_mode()
def logits_diff(loaded, ref) -> float:
    ids = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(0))
    cache = KVCache.for_model(loaded.config, 1, 16, torch.float32, "cpu")
    return float((eaglet_step(loaded, cache, ids) - ref(ids).logits).abs().max())


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """EAGLET_CACHE points at a fresh directory; returns where GGUF conversions land."""
    monkeypatch.setenv("EAGLET_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "gguf"


def entries(d):
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


# ---- the Q/K permutation ----

@pytest.mark.parametrize("shape,n_head", [((64, 64), 4), ((32, 64), 2), ((16, 64), 1), ((64,), 4)])
def test_permute_qk_is_llama_cpps_and_unpermute_inverts_it(shape, n_head):
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    p = permute_qk(w, n_head)
    assert np.array_equal(p, llama_cpp_permute(w, n_head))
    assert np.array_equal(unpermute_qk(p, n_head), w)
    assert np.array_equal(permute_qk(unpermute_qk(w, n_head), n_head), w)
    assert np.array_equal(llama_cpp_unpermute(p, n_head), w)  # the test's own inverse, used below
    assert not np.array_equal(p, w)  # a real reordering, not the identity


# ---- llama arch: F32, Q8_0, Q4_1 ----

def test_f32_file_has_llama_cpp_metadata_and_config(tmp_path):
    hf = hf_model("llama3")
    write_gguf(tmp_path / "m.gguf", hf)
    assert set(LLAMA_CPP_KEYS) <= set(GGUFReader(str(tmp_path / "m.gguf")).fields)
    c = load(tmp_path / "m.gguf").config
    assert (c.model_type, c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers,
            c.num_heads, c.num_kv_heads, c.head_dim, c.max_position) == ("llama", 128, 64, 96, 4, 4, 2, 16, 256)
    assert c.rope.theta == 500000.0 and c.rms_norm_eps == pytest.approx(1e-5)
    assert not c.tie_embeddings and not c.qkv_bias


def test_f32_file_loads_source_weights_exactly(tmp_path):
    hf = hf_model("llama3")
    write_gguf(tmp_path / "m.gguf", hf)
    sd = load(tmp_path / "m.gguf").model.state_dict()
    for name, t in hf.state_dict().items():
        assert torch.equal(sd[name], t), name


def test_f32_file_logits_match_transformers(tmp_path):
    hf = hf_model("llama3")
    write_gguf(tmp_path / "m.gguf", hf)
    assert logits_diff(load(tmp_path / "m.gguf").model, hf) <= TOL


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1], ids=lambda q: q.name)
def test_quantized_file_loads_dequantized_weights_exactly(tmp_path, qtype):
    hf = hf_model("llama3")
    expected = write_gguf(tmp_path / "m.gguf", hf, qtype)
    types = {t.name: t.tensor_type for t in GGUFReader(str(tmp_path / "m.gguf")).tensors}
    assert types["blk.0.attn_q.weight"] == qtype and types["blk.0.attn_norm.weight"] == Q.F32
    sd = load(tmp_path / "m.gguf").model.state_dict()
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(sd[q], hf.state_dict()[q])  # really quantized
    for name, want in expected.items():
        assert torch.equal(sd[name], torch.from_numpy(want)), name


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1], ids=lambda q: q.name)
def test_quantized_file_logits_match_transformers_on_dequantized_weights(tmp_path, qtype):
    hf = hf_model("llama3")
    expected = write_gguf(tmp_path / "m.gguf", hf, qtype)
    assert logits_diff(load(tmp_path / "m.gguf").model, with_weights(hf, expected)) <= TOL


# ---- other shapes of file ----

def test_qwen2_file_with_qkv_bias_is_not_unpermuted(tmp_path):
    hf = hf_model("qwen2")
    write_gguf(tmp_path / "q.gguf", hf, arch="qwen2")
    loaded = load(tmp_path / "q.gguf")
    assert loaded.config.model_type == "qwen2" and loaded.config.qkv_bias
    sd = loaded.model.state_dict()
    for name, t in hf.state_dict().items():
        assert torch.equal(sd[name], t), name
    assert logits_diff(loaded.model, hf) <= TOL


def test_tied_embeddings_without_output_weight(tmp_path):
    hf = hf_model("smollm2")
    write_gguf(tmp_path / "s.gguf", hf)
    assert "output.weight" not in {t.name for t in GGUFReader(str(tmp_path / "s.gguf")).tensors}
    loaded = load(tmp_path / "s.gguf")
    assert loaded.config.tie_embeddings
    assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
    assert torch.equal(loaded.model.lm_head.weight, hf.model.embed_tokens.weight)
    assert logits_diff(loaded.model, hf) <= TOL


# ---- the converted-weights cache ----

def test_second_load_reuses_the_cache(tmp_path, cache_dir, monkeypatch):
    hf = hf_model("llama3")
    write_gguf(tmp_path / "m.gguf", hf, Q.Q8_0)
    first = load(tmp_path / "m.gguf")
    [entry] = entries(cache_dir)
    mtime = (cache_dir / entry / "model.safetensors").stat().st_mtime_ns

    def no_conversion(self):
        raise AssertionError("converted the GGUF file again")
    monkeypatch.setattr(GGUFFile, "tensors", no_conversion)
    second = load(tmp_path / "m.gguf")
    assert entries(cache_dir) == [entry] and second.weights_dir == first.weights_dir
    assert (cache_dir / entry / "model.safetensors").stat().st_mtime_ns == mtime
    for name, t in first.model.state_dict().items():
        assert torch.equal(second.model.state_dict()[name], t), name


def test_changed_file_content_gets_a_new_cache_entry(tmp_path, cache_dir):
    write_gguf(tmp_path / "m.gguf", hf_model("llama3", seed=0))
    load(tmp_path / "m.gguf")
    hf1 = hf_model("llama3", seed=1)
    write_gguf(tmp_path / "m.gguf", hf1)  # same path, new weights: the old entry must not be served
    sd = load(tmp_path / "m.gguf").model.state_dict()
    assert len(entries(cache_dir)) == 2
    for name, t in hf1.state_dict().items():
        assert torch.equal(sd[name], t), name


def test_failed_conversion_leaves_no_cache_entry(tmp_path, cache_dir):
    bad = [("blk.0.ffn_mystery.weight", np.zeros((4, 4), np.float32))]  # after all the good tensors
    write_gguf(tmp_path / "m.gguf", hf_model("llama3"), extra=bad)
    with pytest.raises(ModelLoadError, match="blk.0.ffn_mystery.weight"):
        load(tmp_path / "m.gguf")
    assert entries(cache_dir) == []  # neither a cache entry nor a leftover .tmp-* directory


# ---- bad input ----

def test_unsupported_architecture_is_named(tmp_path, cache_dir):
    w = GGUFWriter(str(tmp_path / "g.gguf"), "gemma3")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="gemma3"):
        load(tmp_path / "g.gguf")
    assert entries(cache_dir) == []


@pytest.mark.parametrize("content", [b"not a model at all\n", b"GGUF\x03\x00"], ids=["text", "truncated-gguf"])
def test_file_that_is_not_a_model_is_a_load_error(tmp_path, content):
    (tmp_path / "model.bin").write_bytes(content)
    with pytest.raises(ModelLoadError):
        load(tmp_path / "model.bin")


def test_qwen3moe_file_loads_per_expert_and_matches_transformers(tmp_path):
    """llama.cpp's qwen3moe layout: the router as ffn_gate_inp, each projection's experts stacked in
    one (E, out, in) tensor (ffn_gate_exps, ffn_up_exps, ffn_down_exps), the expert counts and width
    in the metadata; loaded per expert, its logits are transformers'."""
    ref = hf_model("qwen3_moe", mlp_only_layers=[])  # llama.cpp's qwen3moe has no dense layers
    cfg, state = ref.config, ref.state_dict()
    w = writer(tmp_path / "m.gguf", "qwen3moe", cfg)
    w.add_key_length(cfg.head_dim)
    w.add_expert_count(8)
    w.add_expert_used_count(2)
    w.add_expert_feed_forward_length(32)
    for name, t in state.items():
        m = re.match(r"model\.layers\.(\d+)\.mlp\.(.+)$", name)
        if not m:
            w.add_tensor(hf_to_gguf(name), t.numpy())
        elif m.group(2) == "gate.weight":
            w.add_tensor(f"blk.{m.group(1)}.ffn_gate_inp.weight", t.numpy())
        elif m.group(2) == "experts.gate_up_proj":  # transformers keeps (E, 2I, H): gate rows, then up rows
            w.add_tensor(f"blk.{m.group(1)}.ffn_gate_exps.weight", t[:, :32].contiguous().numpy())
            w.add_tensor(f"blk.{m.group(1)}.ffn_up_exps.weight", t[:, 32:].contiguous().numpy())
        else:
            w.add_tensor(f"blk.{m.group(1)}.ffn_down_exps.weight", t.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    loaded = load(tmp_path / "m.gguf")
    assert loaded.config.moe.num_experts == 8 and loaded.config.moe.sparse(0)
    got = loaded.model.state_dict()
    assert torch.equal(got["model.layers.1.mlp.experts.5.up_proj.weight"], state["model.layers.1.mlp.experts.gate_up_proj"][5, 32:])
    assert logits_diff(loaded.model, ref) <= 1e-4


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])
def test_deepseek2_file_matches_transformers(tmp_path, family):
    """llama.cpp's deepseek2 layout: MLA's projections (attn_q_a / attn_q or attn_q_b, attn_kv_a_mqa,
    their norms), kv_b_proj split for absorption into attn_k_b (heads, kv_lora_rank, nope) and
    attn_v_b (heads, v, kv_lora_rank) as its converter writes it (DeepSeek-V3 here; the older
    unsplit attn_kv_b for V2), stacked routed experts, the shared ones, the router's score bias
    (exp_probs_b), the routing and rope in the metadata; eaglet's logits are transformers'."""
    ref = hf_model(family)
    cfg, v3 = ref.config, family == "deepseek_v3"
    with torch.no_grad():  # a routing bias that matters (transformers initialises it at zero)
        for layer in ref.model.layers[1:]:
            if v3:
                layer.mlp.gate.e_score_correction_bias.copy_(0.1 * torch.randn(cfg.n_routed_experts))
    w = writer(tmp_path / "m.gguf", "deepseek2", cfg)
    w.add_feed_forward_length(cfg.intermediate_size)
    if cfg.q_lora_rank is not None:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(cfg.kv_lora_rank)
    w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    w.add_value_length(cfg.kv_lora_rank)
    w.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    w.add_value_length_mla(cfg.v_head_dim)
    w.add_rope_dimension_count(cfg.qk_rope_head_dim)
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    w.add_expert_weights_norm(bool(cfg.norm_topk_prob) if v3 else False)
    w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID if v3 else ExpertGatingFuncType.SOFTMAX)
    w.add_expert_group_count(cfg.n_group)
    w.add_expert_group_used_count(cfg.topk_group)
    nope, v, inter = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.moe_intermediate_size
    for name, t in ref.state_dict().items():
        m = re.match(r"model\.layers\.(\d+)\.(.+)$", name)
        blk, tail = (m.group(1), m.group(2)) if m else (None, None)
        if tail == "mlp.experts.gate_up_proj":  # (E, 2I, H): gate rows, then up rows
            w.add_tensor(f"blk.{blk}.ffn_gate_exps.weight", t[:, :inter].contiguous().numpy())
            w.add_tensor(f"blk.{blk}.ffn_up_exps.weight", t[:, inter:].contiguous().numpy())
        elif tail == "mlp.experts.down_proj":
            w.add_tensor(f"blk.{blk}.ffn_down_exps.weight", t.numpy())
        elif tail == "self_attn.kv_b_proj.weight" and v3:  # the converter's split
            k_b, v_b = t.view(cfg.num_attention_heads, nope + v, -1).split([nope, v], 1)
            w.add_tensor(f"blk.{blk}.attn_k_b.weight", k_b.transpose(1, 2).contiguous().numpy())
            w.add_tensor(f"blk.{blk}.attn_v_b.weight", v_b.contiguous().numpy())
        else:
            w.add_tensor(hf_to_gguf(name), t.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    loaded = load(tmp_path / "m.gguf")
    assert loaded.config.model_type == family and loaded.config.mla.width == cfg.kv_lora_rank + cfg.qk_rope_head_dim
    assert logits_diff(loaded.model, ref) <= 1e-4
