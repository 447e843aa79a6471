"""GGUF files (llama.cpp): hyper-parameters as a HF config dict, tensors dequantized by the `gguf`
package and renamed through weights/names.py, tokenizer and chat template through transformers.

Supported architectures: llama (Llama 2/3/3.1, Mistral, SmolLM2), qwen2, qwen3, qwen3moe (its
experts stacked in one tensor per layer and projection, loaded per expert), deepseek2 (DeepSeek-V2/V3,
Kimi-K2: MLA, its kv_b_proj split in two by llama.cpp and joined back here). Any tensor type
the `gguf` package can dequantize loads (F32, F16, BF16, Q4_0/1, Q5_0/1, Q8_0, the K-quants...).
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ..errors import ModelLoadError
from .names import GGUF_KV_B_SPLIT, gguf_stacked, gguf_to_hf, qk_heads, unpermute_qk

# GGUF arch -> HF model_type (deepseek2: deepseek_v3 with sigmoid routing, else deepseek_v2)
ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe", "deepseek2": "deepseek_v2"}
PERMUTED_ARCHS = {"llama"}  # llama.cpp permutes Q/K rows only for these


def is_gguf(path: Path) -> bool:
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


class GGUFFile:
    def __init__(self, path: Path):
        from gguf import GGUFReader

        self.path = path
        try:
            self.reader = GGUFReader(str(path))
        except Exception as e:  # gguf raises ValueError/struct errors on corrupt headers
            raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from None
        self.arch = self.field("general.architecture")
        if self.arch not in ARCHS:
            raise ModelLoadError(f"{path}: GGUF architecture {self.arch!r} is not supported "
                                 f"(supported: {', '.join(ARCHS)})")

    def field(self, key: str, default=None):
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def hf_config(self) -> dict:
        a = lambda k, d=None: self.field(f"{self.arch}.{k}", d)  # noqa: E731
        names = {t.name for t in self.reader.tensors}
        heads = int(a("attention.head_count"))
        hidden = int(a("embedding_length"))
        vocab = a("vocab_size") or len(self.reader.fields["tokenizer.ggml.tokens"].data)
        cfg = dict(
            model_type=ARCHS[self.arch],
            hidden_size=hidden,
            intermediate_size=int(a("feed_forward_length", a("expert_feed_forward_length", 0))),
            num_hidden_layers=int(a("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(a("attention.head_count_kv", heads)),
            head_dim=int(a("attention.key_length", hidden // heads)),
            rms_norm_eps=float(a("attention.layer_norm_rms_epsilon", 1e-6)),
            max_position_embeddings=int(a("context_length", 4096)),
            rope_theta=float(a("rope.freq_base", 10000.0)),
            vocab_size=int(vocab),
            tie_word_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            bos_token_id=self.field("tokenizer.ggml.bos_token_id"),
            eos_token_id=self.field("tokenizer.ggml.eos_token_id"),
        )
        if self.arch == "deepseek2":
            cfg.update(self.deepseek2_config(a))
        elif a("expert_count"):  # every layer sparse (llama.cpp's qwen3moe), top-k weights renormalized
            cfg.update(num_experts=int(a("expert_count")), num_experts_per_tok=int(a("expert_used_count")),
                       moe_intermediate_size=int(a("expert_feed_forward_length")), norm_topk_prob=True)
        if a("rope.scaling.type") == "linear":
            cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(a("rope.scaling.factor"))}
        return cfg

    def deepseek2_config(self, a) -> dict:
        """The HF config keys of a deepseek2 file: MLA's ranks and head sizes, the routing (sigmoid:
        DeepSeek-V3's, with groups), the shared experts, the dense first layers, YaRN."""
        rope, kv = int(a("rope.dimension_count")), int(a("attention.kv_lora_rank"))
        sigmoid = int(a("expert_gating_func", 1)) == 2
        groups = int(a("expert_group_count", 1) or 1)
        cfg = dict(model_type="deepseek_v3" if sigmoid else "deepseek_v2", num_key_value_heads=int(a("attention.head_count")),
                   q_lora_rank=a("attention.q_lora_rank"), kv_lora_rank=kv, qk_rope_head_dim=rope,
                   qk_nope_head_dim=int(a("attention.key_length_mla", a("attention.key_length"))) - rope,
                   v_head_dim=int(a("attention.value_length_mla", a("attention.value_length"))),
                   n_routed_experts=int(a("expert_count")), num_experts_per_tok=int(a("expert_used_count")),
                   moe_intermediate_size=int(a("expert_feed_forward_length")),
                   n_shared_experts=int(a("expert_shared_count", 0)),
                   first_k_dense_replace=int(a("leading_dense_block_count", 0)),
                   routed_scaling_factor=float(a("expert_weights_scale", 1.0)),
                   norm_topk_prob=bool(a("expert_weights_norm", False)),
                   topk_method="noaux_tc" if sigmoid else "group_limited_greedy" if groups > 1 else "greedy",
                   n_group=groups, topk_group=int(a("expert_group_used_count", 1) or 1))
        if a("rope.scaling.type") == "yarn":
            mscale = float(a("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
            cfg["rope_scaling"] = dict(type="yarn", factor=float(a("rope.scaling.factor")), mscale=mscale,
                                       mscale_all_dim=mscale,
                                       original_max_position_embeddings=int(a("rope.scaling.original_context_length")))
        return cfg

    def array(self, t) -> np.ndarray:
        """A tensor of the file dequantized to float32, in numpy's dimension order."""
        from gguf import GGMLQuantizationType, quants

        if t.tensor_type == GGMLQuantizationType.F32:
            arr = np.asarray(t.data, dtype=np.float32)
        else:
            try:
                arr = quants.dequantize(t.data, t.tensor_type)
            except NotImplementedError:
                raise ModelLoadError(f"{self.path}: tensor {t.name!r} has type {t.tensor_type.name}, "
                                     "which the gguf package cannot dequantize") from None
        return arr.reshape([int(n) for n in reversed(t.shape)])  # GGUF lists dims fastest-first

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, float32 tensor) for every tensor; an unknown GGUF name is an error naming it."""
        cfg = self.hf_config()
        permuted = self.arch in PERMUTED_ARCHS
        split: dict[str, dict[str, np.ndarray]] = {}  # a layer's attn_k_b / attn_v_b until both are read
        for t in self.reader.tensors:
            hf, stacked = gguf_to_hf(t.name), gguf_stacked(t.name)
            layer, _, part = t.name.removeprefix("blk.").partition(".")
            if part in GGUF_KV_B_SPLIT:
                got = split.setdefault(layer, {})
                got[part] = self.array(t)
                if len(got) == 2:  # (H, kv, nope) transposed back beside (H, v, kv): kv_b_proj (H * (nope + v), kv)
                    k_b, v_b = got.pop(GGUF_KV_B_SPLIT[0]), got.pop(GGUF_KV_B_SPLIT[1])
                    kv_b = np.concatenate([k_b.transpose(0, 2, 1), v_b], 1)
                    yield (f"model.layers.{layer}.self_attn.kv_b_proj.weight",
                           torch.from_numpy(np.ascontiguousarray(kv_b.reshape(-1, kv_b.shape[-1]), dtype=np.float32)))
                continue
            if hf is None and stacked is None:
                raise ModelLoadError(f"{self.path}: unknown tensor {t.name!r} in GGUF file")
            arr = self.array(t)
            if stacked:  # (E, out, in): one tensor per expert
                for e in range(arr.shape[0]):
                    yield stacked.format(e=e), torch.from_numpy(np.array(arr[e], dtype=np.float32))
                continue
            heads = qk_heads(hf, cfg["num_attention_heads"], cfg["num_key_value_heads"]) if permuted else None
            if heads:
                arr = unpermute_qk(arr, heads)
            arr = np.ascontiguousarray(arr, dtype=np.float32)
            yield hf, torch.from_numpy(arr if arr.flags.writeable else arr.copy())

    def save_tokenizer(self, out: Path) -> None:
        """Convert the GGUF tokenizer (and chat template) through transformers and save it as HF files."""
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(str(self.path.parent), gguf_file=self.path.name)
        except Exception as e:  # transformers raises many types for unsupported tokenizers
            raise ModelLoadError(f"{self.path}: cannot convert the GGUF tokenizer ({e})") from None
        tok.save_pretrained(str(out))
