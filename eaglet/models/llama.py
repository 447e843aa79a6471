"""The Llama family in native PyTorch: Llama 2/3/3.1, Mistral, Qwen2, Qwen3, SmolLM2, and with
routed experts in place of the MLP (models/moe.py) Qwen3-MoE and Mixtral, and with latent attention
as well (models/mla.py) DeepSeek-V2/V3 and Kimi-K2.

One implementation; ModelConfig's switches pick qkv bias (Qwen2), q/k RMSNorm (Qwen3), tied
embeddings (SmolLM2), llama3 rope scaling and a sliding window (Mistral). Module names are the HF
checkpoint names, so `state_dict()` keys are exactly what a HF safetensors file holds.

`forward(input_ids, positions, cache, meta)` returns the final (normed) hidden states and,
optionally, the residual stream entering chosen layers (EAGLE-3 taps); `logits(hidden)` is apart
so speculative verify can project only the rows it needs. Attention runs over any cache of the
`Cache` interface (kvcache.py). The kernels a model runs are a frozen `Kernels` value
(eaglet/kernels.py) given at construction and kept by every module that chooses one.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig, rope_inv_freq
from ..kernels import EAGER, Kernels, fusable
from ..kvcache import Cache
from . import cache_attention, exact, exact_attention, gemv, mla, moe
from .attention import AttnMeta
from .linear import Linear, exact_on_gpu, linear


class RMSNorm(nn.Module):
    """RMSNorm; given `residual`, first adds it (x + residual is the new residual stream) and returns
    (normed, new residual), so the add and the norm are one fused kernel once compiled."""

    def __init__(self, dim: int, eps: float, exact: bool = False, few_rows: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.exact = exact  # an exact model's (Kernels.exact): on the GPU each row reduced alike whatever the others
        self.few_rows = few_rows  # a layer's norms where the GEMVs run (Kernels.gemv): up to gemv.MAX_ROWS rows
        # on the GPU as exact.rms_norm's kernel, which chains with the GEMVs around it by dependent launch

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.exact and x.is_cuda and exact.triton is not None:
            return exact.rms_norm(x, self.weight, self.eps, residual)
        if (self.few_rows and x.is_cuda and exact.triton is not None and x.numel() <= gemv.MAX_ROWS * x.shape[-1]
                and x.dtype == self.weight.dtype and not torch.is_grad_enabled()):
            return exact.chained_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
        out = rms_norm(x, self.weight, self.eps)
        return out if residual is None else (out, x)


def embed(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The rows of `weight` (V, H) for `ids` (...) -> (..., H), as F.embedding without its backward.
    For 2 to 63 ids by indexing, one kernel over every element: F.embedding's CUDA index_select for a
    few ids walks them one after another in each thread. On the H200 with SmolLM2's table
    (bench/gpu/gather_probe.py): 16 ids 1.72 µs against 7.84, 4 ids 1.71 against 3.05; one id 2.82
    against 1.92 and 64 alike, so those stay with F.embedding."""
    n = ids.numel()
    return weight[ids] if 1 < n < 64 else F.embedding(ids, weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm's arithmetic (float32 statistics, the result in x's dtype times the weight)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class RoPE(nn.Module):
    """Rotary embedding of q (B, T, H, D) and k (B, T, Hkv, D) with cos, sin (B, T, 1, D), returning
    what attention and the cache take: q (B, Hkv, G*T, D), each kv head's G query heads stacked as
    rows (head h = kv * G + g, row g * T + t), and keys with values (B, T, 2, Hkv, D). A module with
    no weights, so the runtime compiles it: rotation and relayout become one kernel per output
    instead of a rotation and then a copy. With one token q's heads are already in that order, so
    q, k and v go into one tensor, one kernel, and both results are views of it. (A few tokens
    over the cache on the GPU skip it: cache_attention rotates as it loads.)"""

    def __init__(self, groups: int):
        super().__init__()
        self.groups = groups

    def forward(self, q, k, v, cos, sin):
        b, t, h, d = q.shape
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        hkv = h // self.groups
        if t == 1:
            out = torch.cat([q, k, v], 2)  # (B, 1, H + 2 Hkv, D)
            return out[:, 0, :h].view(b, hkv, self.groups, d), out[:, :, h:].view(b, 1, 2, hkv, d)
        q = q.view(b, t, hkv, self.groups, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, self.groups * t, d)
        return q, torch.stack([k, v], 2)


class Rotary(nn.Module):
    """RoPE from positions. `freq_factors` are llama.cpp's per-frequency divisors (GGUF
    `rope_freqs`), ones otherwise; scaling from the config is already in `inv_freq`."""

    def __init__(self, config: ModelConfig, kernels: Kernels = EAGER):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(config.rope, config.head_dim), persistent=False)
        self.register_buffer("freq_factors", torch.ones(config.head_dim // 2))
        self.cos_sin = kernels.fuse(rope_cos_sin)
        self.scale = config.rope.cos_sin_scale()  # YaRN's attention factor (1 otherwise)

    def reset_buffers(self, config: ModelConfig) -> None:
        self.inv_freq = rope_inv_freq(config.rope, config.head_dim).to(self.inv_freq.device)
        self.freq_factors.fill_(1.0)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos_sin(positions, self.inv_freq, dtype, self.freq_factors, self.scale)


@fusable
def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype,
                 freq_factors: torch.Tensor | None = None, scale: float = 1.0):
    """positions (B, T) -> cos, sin (B, T, 1, D) in HF's rotate-half layout, times `scale`; inv_freq
    divided by freq_factors when given. Compiled on the GPU: one kernel instead of seven per forward."""
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.float()
    freqs = positions[..., None].float() * inv_freq  # (B, T, D/2)
    emb = torch.cat([freqs, freqs], -1)  # (B, T, D)
    return (emb.cos() * scale).to(dtype)[:, :, None], (emb.sin() * scale).to(dtype)[:, :, None]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, in_features: int | None = None, kernels: Kernels = EAGER):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.layer, self.nh, self.nkv, self.d = layer, config.num_heads, config.num_kv_heads, d
        self.kernels = kernels
        fin = in_features or h  # EAGLE-3's midlayer reads [embedding; hidden], 2H wide
        self.q_proj = Linear(fin, self.nh * d, bias=config.qkv_bias, kernels=kernels)
        self.k_proj = Linear(fin, self.nkv * d, bias=config.qkv_bias, kernels=kernels)
        self.v_proj = Linear(fin, self.nkv * d, bias=config.qkv_bias, kernels=kernels)
        self.o_proj = Linear(self.nh * d, h, bias=config.o_bias, kernels=kernels)
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps, kernels.exact)
            self.k_norm = RMSNorm(d, config.rms_norm_eps, kernels.exact)
        self.qk_norm = config.qk_norm
        self.rope = RoPE(self.nh // self.nkv)
        self.fused = False

    def fuse(self) -> None:
        """One matmul for q, k and v: the three weights become views of one tensor (names unchanged)."""
        w, b = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        self.register_buffer("qkv_weight", w, persistent=False)
        self.register_buffer("qkv_bias", b, persistent=False)
        self.fused = True

    def project(self, x: torch.Tensor):
        if not self.fused:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        qkv = linear(x, self.qkv_weight, self.qkv_bias, self.kernels)
        return qkv.split([self.nh * self.d, self.nkv * self.d, self.nkv * self.d], -1)

    def forward(self, x, cos, sin, cache: Cache, meta: AttnMeta | None) -> torch.Tensor:
        b, t, _ = x.shape
        kernel = self.kernels.cache_attention or self.kernels.exact and x.is_cuda
        if kernel and cache.in_place and meta.fast and cache_attention.usable(x, t):
            # a few tokens per row: q/k norm, RoPE, store, attend and lay out in one kernel (exact: three,
            # each token's keys read as its decode step reads them)
            qkv = (linear(x, self.qkv_weight, self.qkv_bias, self.kernels) if self.fused
                   else torch.cat(self.project(x), -1))
            norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else None
            attend = exact_attention.exact_attention if self.kernels.exact else cache_attention.cache_attention
            o = attend(qkv.view(b, t, -1, self.d), *cache.layer_kv(self.layer, b), meta.slots[:, 0], meta.block_mask,
                       meta.kv_len, self.nh // self.nkv, rope=(cos, sin), qk_norm=norm, pending=meta.pending)
            return self.o_proj(o)
        q, k, v = self.project(x)
        q = q.view(b, t, self.nh, self.d)
        k = k.view(b, t, self.nkv, self.d)
        v = v.view(b, t, self.nkv, self.d)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, kv = self.rope(q, k, v, cos, sin)  # (B, Hkv, G*T, D), (B, T, 2, Hkv, D)
        o = cache.attend(self.layer, q, kv, meta)  # (B, H, T, D)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, self.nh * self.d))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, kernels: Kernels = EAGER):
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.kernels = kernels
        self.gate_proj = Linear(h, i, bias=bias, kernels=kernels)
        self.up_proj = Linear(h, i, bias=bias, kernels=kernels)
        self.down_proj = Linear(i, h, bias=bias, kernels=kernels)
        self.fused = False

    def fuse(self) -> None:
        w, b = fuse_linears([self.gate_proj, self.up_proj])
        self.register_buffer("gate_up_weight", w, persistent=False)  # not in the state dict
        self.register_buffer("gate_up_bias", b, persistent=False)
        self.fused = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fused:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        rows = x.numel() // x.shape[-1]
        if self.kernels.exact and exact_on_gpu(x, self.gate_up_weight):  # gate-up and SiLU·mul, row-invariant
            return self.down_proj(gemv.exact(x, self.gate_up_weight, self.gate_up_bias, glu=True))
        if self.kernels.gemv and gemv.usable(x, self.gate_up_weight, rows, glu=True):  # few rows: one kernel
            return self.down_proj(gemv.glu(x, self.gate_up_weight, self.gate_up_bias))
        gate, up = linear(x, self.gate_up_weight, self.gate_up_bias, self.kernels).chunk(2, -1)
        return self.down_proj(F.silu(gate) * up)


def fuse_linears(linears: list[Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) of linears that read the same input into one tensor and
    make each module's parameters views of it: the state dict keeps its checkpoint names and
    shapes, and one matmul replaces several. For inference: gradients would not reach the views."""
    w = torch.cat([m.weight.data for m in linears])
    b = torch.cat([m.bias.data for m in linears]) if linears[0].bias is not None else None
    lo = 0
    for m in linears:
        hi = lo + m.weight.shape[0]
        m.weight.data = w[lo:hi]
        if b is not None:
            m.bias.data = b[lo:hi]
        lo = hi
    return w, b


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, kernels: Kernels = EAGER):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels.exact, kernels.gemv)
        self.self_attn = (mla.MLAttention if config.mla is not None else Attention)(config, layer, kernels=kernels)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels.exact, kernels.gemv)
        if config.moe is not None and config.moe.sparse(layer):  # under the checkpoint's name for it
            self.ffn_name = moe.NAMES[config.model_type][0]
            setattr(self, self.ffn_name, moe.SparseMoE(config, kernels))
        else:
            self.ffn_name, self.mlp = "mlp", MLP(config, kernels)

    @property
    def ffn(self) -> nn.Module:
        """The feed-forward module: a dense MLP or routed experts (SparseMoE)."""
        return getattr(self, self.ffn_name)

    def forward(self, h, residual, cos, sin, cache, meta):
        """h: this layer's input before the residual add; residual: the stream so far (None at the
        first layer). Returns (mlp output, residual stream): their sum is the layer's output."""
        x, residual = self.input_layernorm(h, residual) if residual is not None else (self.input_layernorm(h), h)
        a = self.self_attn(x, cos, sin, cache, meta)
        if isinstance(self.ffn, moe.SparseMoE):  # the norm inside the routing kernel where it runs
            return self.ffn.normed(a, residual, self.post_attention_layernorm)
        x, residual = self.post_attention_layernorm(a, residual)
        return self.ffn(x), residual


class Decoder(nn.Module):
    def __init__(self, config: ModelConfig, kernels: Kernels = EAGER):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_rows, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, kernels) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels.exact, kernels.gemv)
        self.rotary = Rotary(config, kernels)


class CausalLM(nn.Module):
    """A Llama-family target model. State-dict keys are HF's (`model.layers.0.self_attn.q_proj.weight`).
    `kernels` is what it runs (eaglet/kernels.py); decoders and drafters working with it take the same."""

    def __init__(self, config: ModelConfig, kernels: Kernels = EAGER):
        super().__init__()
        self.config, self.kernels = config, kernels
        self.model = Decoder(config, kernels)
        self.lm_head = Linear(config.hidden_size, config.vocab_rows, bias=False, kernels=kernels)  # dist/vocab.py
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: Cache, meta: AttnMeta | None,
                capture: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids, positions: (B, T). Writes K/V of the new tokens into `cache` at meta.slots
        (the caller commits them). Returns hidden (B, T, H) after the final norm, and when `capture`
        names layers, the residual stream entering each, concatenated: (B, T, len(capture) * H)."""
        h = self.embed(input_ids)  # (B, T, H)
        cos, sin = self.model.rotary(positions, h.dtype)
        taps, residual = {}, None
        for i, layer in enumerate(self.model.layers):
            if i in capture:
                taps[i] = h if residual is None else h + residual  # the stream entering layer i
            h, residual = layer(h, residual, cos, sin, cache, meta)
        aux = torch.cat([taps[i] for i in capture], -1) if capture else None  # in capture's order, repeats kept
        return self.model.norm(h, residual)[0], aux

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The input embedding of `ids` (...) -> (..., H) (a collective under vocabulary parallelism)."""
        if self.config.vocab_slice is None:
            return embed(self.model.embed_tokens.weight, ids)
        from ..dist import vocab

        return vocab.lookup(self.model.embed_tokens.weight, ids, self.config.vocab_slice[0])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., H) -> (..., V) over the whole vocabulary (gathered under vocabulary parallelism)."""
        if self.config.vocab_slice is None:
            return self.lm_head(hidden)
        from ..dist import vocab

        return vocab.gather(self.lm_head(hidden), self.config.vocab_size)

    def output_weight(self) -> torch.Tensor:
        """The whole (V, H) output layer (see whole_table)."""
        return self.whole_table(self.lm_head.weight)

    def input_weight(self) -> torch.Tensor:
        """The whole (V, H) embedding table (see whole_table)."""
        return self.whole_table(self.model.embed_tokens.weight)

    def whole_table(self, weight: torch.Tensor) -> torch.Tensor:
        """`weight` itself, or under vocabulary parallelism a copy of the whole table gathered from
        every rank's rows (a collective: every rank calls it; training and drafter loading use it)."""
        if self.config.vocab_slice is None:
            return weight
        from ..dist import vocab

        return vocab.whole_table(weight, self.config.vocab_size)

    def fuse_projections(self) -> None:
        """For inference: q/k/v and gate/up each as one matmul (see fuse_linears)."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.ffn.fuse()

    def post_materialize(self) -> None:
        """After building on the meta device and `to_empty`: re-tie weights, recompute buffers."""
        self.tie_weights()
        self.model.rotary.reset_buffers(self.config)
        for m in self.modules():
            if isinstance(m, moe.SparseMoE):
                m.reset_buffers()


def compile_elementwise(model: nn.Module) -> int:
    """torch.compile, in place, the elementwise modules of `model` (a target or a drafter head):
    RMSNorm with its residual add, RoPE with its relayout, the MLP's gate-up / SiLU·mul / down, each
    one generated kernel instead of five to ten small ones. For models whose Kernels.compile is on;
    returns how many modules."""
    # one entry per (module code, specialization: size-1 dims, residual or not), shared by all layers
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    n = 0
    for m in model.modules():
        if isinstance(m, (RMSNorm, RoPE, MLP)):
            m.compile(dynamic=True, fullgraph=True)
            n += 1
    return n
