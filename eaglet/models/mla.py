"""Multi-head Latent Attention (DeepSeek-V2/V3, Kimi-K2) over a latent cache.

Per token and layer the cache keeps what MLA compresses the keys and values into: the normed latent
c (kv_lora_rank) and the shared rotated key k_pe (qk_rope_head_dim), one entry of
kv_lora_rank + qk_rope_head_dim values (576 for DeepSeek-V3 and Kimi-K2) instead of 2 x heads x
head_dim. Two ways to attend over it, equal up to rounding:

- expanded (a prefill over its own tokens): kv_b_proj turns each latent into every head's key
  (nope part, then k_pe) and value, then ordinary attention;
- absorbed (decode and verify over the cache): kv_b_proj's key rows are folded into the query
  (q_nope W_k: a query in latent space, scored against c directly, plus q_pe . k_pe) and its value
  rows into the output (the attention-weighted latent times W_v), so nothing per cached token is
  expanded.

The rotary part is laid out in interleaved pairs in these checkpoints (DeepSeek's complex
rotation); it is de-interleaved before the rotate-half rotation, for queries and keys alike, so
their dot products are those of the interleaved rotation. Module names are the checkpoints'.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..kernels import EAGER, Kernels, fusable
from . import exact, mla_attention, mla_heads
from .linear import Linear, linear


class MLAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, kernels: Kernels = EAGER):
        super().__init__()
        from .llama import RMSNorm  # the same norm as every layer's (llama.py imports this module)

        m = self.mla = config.mla
        h, nh = config.hidden_size, config.num_heads
        self.layer, self.nh, self.kernels = layer, nh, kernels
        self.fused = 0  # rows of the fused input projection that are q's (fuse)
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank is None:
            self.q_proj = Linear(h, nh * qk, bias=False, kernels=kernels)
        else:
            self.q_a_proj = Linear(h, m.q_lora_rank, bias=config.qkv_bias, kernels=kernels)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, 1e-6, kernels.exact)
            self.q_b_proj = Linear(m.q_lora_rank, nh * qk, bias=False, kernels=kernels)
        self.kv_a_proj_with_mqa = Linear(h, m.kv_lora_rank + m.qk_rope_head_dim, bias=config.qkv_bias, kernels=kernels)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, 1e-6, kernels.exact)
        self.kv_b_proj = Linear(m.kv_lora_rank, nh * (m.qk_nope_head_dim + m.v_head_dim), bias=False, kernels=kernels)
        self.o_proj = Linear(nh * m.v_head_dim, h, bias=config.o_bias, kernels=kernels)
        self.scale = config.rope.softmax_scale() / math.sqrt(qk)  # YaRN's mscale_all_dim squared, as DeepSeek
        self.rope_entry = kernels.fuse(rope_entry)  # on the GPU one kernel each instead of a dozen
        self.latent_softmax = kernels.fuse(latent_softmax)

    def fuse(self) -> None:
        """The two projections of the layer's input, q (or q_a) and kv_a, as one matmul (their weights
        views of one tensor, names unchanged: llama.fuse_linears), where their biases agree; the
        absorbed form reads kv_b_proj's weight as it is."""
        first = self.q_proj if self.mla.q_lora_rank is None else self.q_a_proj
        if (first.bias is None) == (self.kv_a_proj_with_mqa.bias is None):
            from .llama import fuse_linears  # llama.py imports this module

            w, b = fuse_linears([first, self.kv_a_proj_with_mqa])
            self.register_buffer("input_weight", w, persistent=False)
            self.register_buffer("input_bias", b, persistent=False)
            self.fused = first.weight.shape[0]

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The queries (B, T, nh * (nope + rope)) and the kv_a projection (B, T, kv_lora_rank + rope)."""
        m = self.mla
        if self.fused:
            q, kv = linear(x, self.input_weight, self.input_bias, self.kernels).split(
                [self.fused, m.kv_lora_rank + m.qk_rope_head_dim], -1)
        else:
            q, kv = (self.q_proj if m.q_lora_rank is None else self.q_a_proj)(x), self.kv_a_proj_with_mqa(x)
        return (q if m.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(q))), kv

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, meta) -> torch.Tensor:
        m, (b, t, _) = self.mla, x.shape
        q, kv = self.project(x)
        q_nope, q_pe = q.view(b, t, self.nh, -1).split([m.qk_nope_head_dim, m.qk_rope_head_dim], -1)
        if (self.kernels.cache_attention and cache.in_place and cache.absorbed and meta.fast
                and mla_attention.usable(x, t, m.kv_lora_rank, m.qk_rope_head_dim)):
            # a few tokens a row: norm, RoPE, store and attend in the latent space in one kernel
            w = self.kv_b_proj.weight.view(self.nh, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
            heads = mla_heads.usable(x, b * t, m.qk_nope_head_dim, m.kv_lora_rank)  # one token: no cuBLAS bmm
            q_lat = (mla_heads.absorb(q_nope.view(self.nh, -1), w, m.qk_nope_head_dim).view(b, t, self.nh, -1)
                     if heads else  # any strides but the last
                     torch.einsum("bthn,hnc->bthc", q_nope, w[:, :m.qk_nope_head_dim]))
            o_lat = mla_attention.mla_attention(
                q_lat, q_pe, kv, (self.kv_a_layernorm.weight, self.kv_a_layernorm.eps), cache.k[self.layer, :b, 0],
                meta.slots[:, 0], meta.block_mask, meta.kv_len, meta.pending, (cos, sin), m.rope_interleave, self.scale)
            # each head's value rows, written straight into o_proj's (B*T, nh * v) rows (an einsum's
            # head-major result would be copied into them)
            o = o_lat.new_empty(b * t, self.nh, m.v_head_dim)
            if heads:
                mla_heads.values(o_lat.view(self.nh, m.kv_lora_rank), w, m.qk_nope_head_dim, o.view(self.nh, -1))
            else:
                torch.bmm(o_lat.view(b * t, self.nh, m.kv_lora_rank).transpose(0, 1),
                          w[:, m.qk_nope_head_dim:].transpose(1, 2), out=o.transpose(0, 1))
            return self.o_proj(o.view(b, t, -1))
        c, k_pe = kv.split([m.kv_lora_rank, m.qk_rope_head_dim], -1)
        q_pe, entry = self.rope_entry(q_pe, k_pe, self.kv_a_layernorm(c), cos, sin, m.rope_interleave)
        latent, mask = cache.latent(self.layer, entry, meta)  # (B, S, W) to attend over, bias (B, 1, T, S)
        attend, args = ((attend_absorbed, (self.kv_b_proj.weight, m, self.scale, self.latent_softmax))
                        if cache.absorbed else (attend_expanded, (self.kv_b_proj.weight, m, self.scale)))
        if exact.applies(meta, t) and cache.in_place or meta is not None and meta.prompt_lens is not None:
            o = exact.attend_latent_rows(attend, q_nope, q_pe, latent, meta, *args)
        else:
            o = attend(q_nope, q_pe, latent, mask, *args)  # (B, T, nh, v)
        return self.o_proj(o.reshape(b, t, -1))


@fusable
def rope_entry(q_pe: torch.Tensor, k_pe: torch.Tensor, c: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q's rotary part (B, T, nh, R) rotated, and what the cache keeps of each token: the normed
    latent c and the rotated shared key k_pe (B, T, R), (B, T, kv_lora_rank + R)."""
    k_pe = rotate(k_pe[:, :, None], cos, sin, interleaved)[:, :, 0]
    return rotate(q_pe, cos, sin, interleaved), torch.cat([c, k_pe], -1)


@fusable
def latent_softmax(nope: torch.Tensor, pe: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention weights from the latent and rotary scores (B, nh, T, S) and the mask's bias, in float32
    and back to the scores' dtype."""
    return ((nope + pe) * scale).float().add(mask).softmax(-1).to(nope.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """RoPE of x (B, T, heads, R) with cos, sin (B, T, 1, R); interleaved pairs are de-interleaved first."""
    from .llama import rotate_half  # llama.py imports this module

    if interleaved:
        x = torch.cat([x[..., 0::2], x[..., 1::2]], -1)
    return x * cos + rotate_half(x) * sin


def attend_expanded(q_nope, q_pe, latent, mask, w_kv, m, scale) -> torch.Tensor:
    """Every head's keys and values from the latents (kv_b_proj), then attention: (B, T, nh, v)."""
    b, t, nh, _ = q_nope.shape
    s = latent.shape[1]
    kv = F.linear(latent[..., :m.kv_lora_rank], w_kv).view(b, s, nh, -1)
    k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], -1)
    k = torch.cat([k_nope, latent[:, :, None, m.kv_lora_rank:].expand(b, s, nh, m.qk_rope_head_dim)], -1)
    q = torch.cat([q_nope, q_pe], -1)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=mask, scale=scale)  # (B, nh, T, v)
    return o.transpose(1, 2)


def attend_absorbed(q_nope, q_pe, latent, mask, w_kv, m, scale, softmax=latent_softmax) -> torch.Tensor:
    """kv_b_proj's key rows folded into the query and its value rows into the output: attention in
    the latent space, nothing expanded per cached token: (B, T, nh, v). `softmax`: latent_softmax,
    compiled where the model compiles."""
    nh = q_nope.shape[2]
    w = w_kv.view(nh, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
    w_k, w_v = w[:, :m.qk_nope_head_dim], w[:, m.qk_nope_head_dim:]
    c, k_pe = latent[..., :m.kv_lora_rank], latent[..., m.kv_lora_rank:]
    q_lat = torch.einsum("bthn,hnc->bhtc", q_nope, w_k)  # (B, nh, T, kv_lora_rank)
    p = softmax(torch.einsum("bhtc,bsc->bhts", q_lat, c), torch.einsum("bthr,bsr->bhts", q_pe, k_pe), mask,
                scale)  # (B, nh, T, S)
    o_lat = torch.einsum("bhts,bsc->bthc", p, c)  # (B, T, nh, kv_lora_rank)
    return torch.einsum("bthc,hvc->bthv", o_lat, w_v)
