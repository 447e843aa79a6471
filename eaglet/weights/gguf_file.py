"""GGUF files (llama.cpp): hyper-parameters as a HF config dict, tensors dequantized by the `gguf`
package and renamed through weights/names.py, tokenizer and chat template through transformers.

Supported architectures: llama (Llama 2/3/3.1, Mistral, SmolLM2), qwen2, qwen3, qwen3moe (its
experts stacked in one tensor per layer and projection, loaded per expert). Any tensor type
the `gguf` package can dequantize loads (F32, F16, BF16, Q4_0/1, Q5_0/1, Q8_0, the K-quants...).
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ..errors import ModelLoadError
from .names import gguf_stacked, gguf_to_hf, qk_heads, unpermute_qk

ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe"}  # GGUF arch -> HF model_type
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
        if a("expert_count"):  # every layer sparse (llama.cpp's qwen3moe), top-k weights renormalized
            cfg.update(num_experts=int(a("expert_count")), num_experts_per_tok=int(a("expert_used_count")),
                       moe_intermediate_size=int(a("expert_feed_forward_length")), norm_topk_prob=True)
        if a("rope.scaling.type") == "linear":
            cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(a("rope.scaling.factor"))}
        return cfg

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, float32 tensor) for every tensor; an unknown GGUF name is an error naming it."""
        from gguf import GGMLQuantizationType, quants

        cfg = self.hf_config()
        permuted = self.arch in PERMUTED_ARCHS
        for t in self.reader.tensors:
            hf, stacked = gguf_to_hf(t.name), gguf_stacked(t.name)
            if hf is None and stacked is None:
                raise ModelLoadError(f"{self.path}: unknown tensor {t.name!r} in GGUF file")
            if t.tensor_type == GGMLQuantizationType.F32:
                arr = np.asarray(t.data, dtype=np.float32)
            else:
                try:
                    arr = quants.dequantize(t.data, t.tensor_type)
                except NotImplementedError:
                    raise ModelLoadError(f"{self.path}: tensor {t.name!r} has type {t.tensor_type.name}, "
                                         "which the gguf package cannot dequantize") from None
            arr = arr.reshape([int(n) for n in reversed(t.shape)])  # GGUF lists dims fastest-first
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
