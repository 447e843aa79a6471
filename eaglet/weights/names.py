"""The one table of tensor names: GGUF (llama.cpp) names -> HF module names, and llama.cpp's Q/K
row permutation, undone here and nowhere else.

HF names are eaglet's module names, so a safetensors checkpoint needs no table: its keys are
looked up in the model's state dict directly.
"""
from __future__ import annotations

import re

import numpy as np

# HF tensors eaglet recomputes instead of loading
IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")

_LAYER = "model.layers.{i}."
GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "model.rotary.freq_factors",
    "blk.{i}.attn_norm.weight": _LAYER + "input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": _LAYER + "post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": _LAYER + "self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": _LAYER + "self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": _LAYER + "self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": _LAYER + "self_attn.o_proj.weight",
    "blk.{i}.attn_q.bias": _LAYER + "self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": _LAYER + "self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": _LAYER + "self_attn.v_proj.bias",
    "blk.{i}.attn_output.bias": _LAYER + "self_attn.o_proj.bias",
    "blk.{i}.attn_q_norm.weight": _LAYER + "self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": _LAYER + "self_attn.k_norm.weight",
    "blk.{i}.ffn_gate.weight": _LAYER + "mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": _LAYER + "mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": _LAYER + "mlp.down_proj.weight",
}
# routed experts (qwen3moe): one GGUF tensor stacks every expert's weight, (E, out, in); eaglet
# loads them per expert, under the checkpoint's names
GGUF_TO_HF["blk.{i}.ffn_gate_inp.weight"] = _LAYER + "mlp.gate.weight"  # the router
# deepseek2 (DeepSeek-V2/V3, Kimi-K2): MLA's projections, the shared experts, the router's score bias
GGUF_TO_HF.update({
    "blk.{i}.attn_q_a.weight": _LAYER + "self_attn.q_a_proj.weight",
    "blk.{i}.attn_q_a_norm.weight": _LAYER + "self_attn.q_a_layernorm.weight",
    "blk.{i}.attn_q_b.weight": _LAYER + "self_attn.q_b_proj.weight",
    "blk.{i}.attn_kv_a_mqa.weight": _LAYER + "self_attn.kv_a_proj_with_mqa.weight",
    "blk.{i}.attn_kv_a_norm.weight": _LAYER + "self_attn.kv_a_layernorm.weight",
    "blk.{i}.attn_kv_b.weight": _LAYER + "self_attn.kv_b_proj.weight",
    "blk.{i}.ffn_gate_shexp.weight": _LAYER + "mlp.shared_experts.gate_proj.weight",
    "blk.{i}.ffn_up_shexp.weight": _LAYER + "mlp.shared_experts.up_proj.weight",
    "blk.{i}.ffn_down_shexp.weight": _LAYER + "mlp.shared_experts.down_proj.weight",
    "blk.{i}.exp_probs_b.bias": _LAYER + "mlp.gate.e_score_correction_bias",
})
# llama.cpp splits kv_b_proj for absorption: attn_k_b (heads, kv_lora_rank, nope), transposed, and
# attn_v_b (heads, v, kv_lora_rank); eaglet joins them back into kv_b_proj
GGUF_KV_B_SPLIT = ("attn_k_b.weight", "attn_v_b.weight")
GGUF_STACKED = {
    "blk.{i}.ffn_gate_exps.weight": _LAYER + "mlp.experts.{e}.gate_proj.weight",
    "blk.{i}.ffn_up_exps.weight": _LAYER + "mlp.experts.{e}.up_proj.weight",
    "blk.{i}.ffn_down_exps.weight": _LAYER + "mlp.experts.{e}.down_proj.weight",
}
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")


def gguf_stacked(name: str) -> str | None:
    """The per-expert HF name pattern ({e} for the expert) of a stacked GGUF expert tensor, or None."""
    m = _BLK.match(name)
    hf = GGUF_STACKED.get("blk.{i}." + m.group(2)) if m else None
    return hf.replace("{i}", m.group(1)) if hf else None


def gguf_to_hf(name: str) -> str | None:
    """HF name for a GGUF tensor name, or None when the table has no entry."""
    m = _BLK.match(name)
    if m:
        hf = GGUF_TO_HF.get("blk.{i}." + m.group(2))
        return hf.format(i=m.group(1)) if hf else None
    return GGUF_TO_HF.get(name)


def hf_to_gguf(name: str) -> str | None:
    """GGUF name for a HF name (for writing GGUF files in tests and tools)."""
    m = re.match(r"^model\.layers\.(\d+)\.(.+)$", name)
    for g, h in GGUF_TO_HF.items():
        if m and h == _LAYER + m.group(2):
            return g.format(i=m.group(1))
        if not m and h == name:
            return g
    return None


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter permutation of q/k rows (rotate-half pairs -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of `permute_qk`: back to HF's rotate-half row order."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def qk_heads(hf_name: str, num_heads: int, num_kv_heads: int) -> int | None:
    """How many heads a llama-arch GGUF tensor was permuted with (None: not permuted)."""
    if ".self_attn.q_proj." in hf_name:
        return num_heads
    if ".self_attn.k_proj." in hf_name:
        return num_kv_heads
    return None
