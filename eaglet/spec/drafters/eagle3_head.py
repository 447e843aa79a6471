"""The EAGLE-3 draft head (docs/eagle3.md): `fc` fuses the target's residual
stream entering three layers (low, mid, high); one decoder layer ("midlayer") attends over
[input_layernorm(embed(token)); hidden_norm(h)]; `norm` then `lm_head` over the draft vocabulary,
mapped to target ids by the `d2t` offsets. Module names are the SGLang/SpecForge checkpoint names.

A head of several layers (`cfg.layer.num_layers`) is vLLM's: layers 1, 2, ... (`layers.1.*`, ...) are
plain pre-norm Llama decoder layers continuing the midlayer's residual stream, each with its own
attention over its own keys; the feedback and `norm` take the last layer's output.

The token embedding is the target's (frozen) unless a checkpoint brings its own; it is passed in
as embeddings so the head's state dict never holds a copy of it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from ...config import ModelConfig, rope_inv_freq
from ...kernels import EAGER, Kernels, fusable
from ...kvcache import Cache
from ...models.attention import AttnMeta
from ...models.linear import Linear
from ...models.llama import MLP, Attention, DecoderLayer, RMSNorm, rms_norm, rope_cos_sin


@dataclass(frozen=True)
class Eagle3Config:
    layer: ModelConfig  # the midlayer's shape; vocab_size is the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...]  # target layers whose *input* residual stream is tapped
    norm_before_residual: bool = False  # vLLM speculators option: residual = hidden_norm(h)
    shared_lm_head: bool = False  # drafts through the target's output layer (whole vocabulary; none in the checkpoint)

    @staticmethod
    def for_target(target: ModelConfig, draft_vocab_size: int | None = None, intermediate_size: int | None = None,
                   num_heads: int | None = None, num_kv_heads: int | None = None,
                   num_layers: int = 1) -> "Eagle3Config":
        """A head of `num_layers` layers shaped like the target's (its MLP width and head counts unless given),
        tapping the default layers 2, N//2, N-3. A tensor-parallel slice's head is the whole model's."""
        target = target.whole or target
        layer = target.replace(num_layers=num_layers, qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False,
                               sliding_window=None, tie_embeddings=False, model_type="llama",
                               moe=None, mla=None,  # a dense Llama layer whatever the target's
                               bos_token_id=None, eos_token_ids=(),  # not the head's (save_eagle3 drops them)
                               intermediate_size=intermediate_size or target.intermediate_size,
                               num_heads=num_heads or target.num_heads, num_kv_heads=num_kv_heads or target.num_kv_heads)
        return Eagle3Config(layer=layer, draft_vocab_size=draft_vocab_size or target.vocab_size,
                            target_hidden_size=target.hidden_size, aux_layers=target.default_eagle_layers)


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: Eagle3Config, kernels: Kernels = EAGER):
        super().__init__()
        c = cfg.layer
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c, layer=0, in_features=2 * c.hidden_size, kernels=kernels)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c, kernels)
        self.norm_before_residual = cfg.norm_before_residual
        self.input = kernels.fuse(midlayer_input)

    def forward(self, emb, h, cos, sin, cache: Cache, meta: AttnMeta | None):
        """(MLP output, residual stream), as models.llama.DecoderLayer returns them: their sum is the
        layer's output, and the next norm adds them in its kernel."""
        e, n = self.input_layernorm, self.hidden_norm
        x, hn = self.input(emb, h, e.weight, n.weight, e.eps, n.eps)  # (B, T, 2H): embedding first
        # the residual add and the norm in one kernel (RMSNorm with a residual returns both)
        x, h = self.post_attention_layernorm(self.self_attn(x, cos, sin, cache, meta),
                                             hn if self.norm_before_residual else h)
        return self.mlp(x), h


@fusable
def midlayer_input(emb, h, emb_weight, hidden_weight, emb_eps: float, hidden_eps: float):
    """[input_layernorm(emb); hidden_norm(h)] (B, T, 2H) and hidden_norm(h): one kernel on the GPU
    for two norms and a concatenation."""
    hn = rms_norm(h, hidden_weight, hidden_eps)
    return torch.cat([rms_norm(emb, emb_weight, emb_eps), hn], -1), hn


def random_like_rows(w: torch.Tensor, n: int, generator: torch.Generator | None) -> torch.Tensor:
    """n new rows for weight w (out, in): normal at w's scale, drawn on the CPU (the same draw on any
    device), in w's dtype and device."""
    return torch.randn(n, w.shape[1], generator=generator, dtype=torch.float32).to(w) * w.float().std()


class Eagle3Head(nn.Module):
    """`kernels`: what the head runs (eaglet/kernels.py), the target's when it drafts for one; EAGER for
    training and for the heads that widen or reshape this one."""

    def __init__(self, cfg: Eagle3Config, kernels: Kernels = EAGER):
        super().__init__()
        c = cfg.layer
        self.cfg, self.kernels = cfg, kernels
        self.fc = Linear(len(cfg.aux_layers) * cfg.target_hidden_size, c.hidden_size, bias=False, kernels=kernels)
        self.midlayer = Eagle3Layer(cfg, kernels)
        # vLLM's later layers, named as in its checkpoints (layers.1, layers.2, ...): the target's decoder layer
        self.layers = nn.ModuleDict({str(i): DecoderLayer(c, i, kernels) for i in range(1, c.num_layers)})
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = Linear(c.hidden_size, cfg.draft_vocab_size, bias=False, kernels=kernels)
        self.cos_sin = kernels.fuse(rope_cos_sin)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(c.vocab_size, dtype=torch.bool))
        self.register_buffer("inv_freq", rope_inv_freq(c.rope, c.head_dim), persistent=False)

    def widen_mlp(self, size: int, generator: torch.Generator | None = None) -> "Eagle3Head":
        """This head with a wider MLP that computes exactly what this one does: the new gate and up
        rows are random (at the scale of the old ones), the new down columns zero, so training starts
        from this head's function and grows into the added width. The head stays in the SGLang
        format (intermediate_size is in its config.json)."""
        mlp, old = self.midlayer.mlp, self.cfg.layer.intermediate_size
        self.one_layer("widen_mlp")
        if mlp.fused:
            raise ValueError("widen_mlp: the head's projections are fused (inference only)")
        if size < old:
            raise ValueError(f"widen_mlp: {size} is narrower than the head's MLP ({old})")
        extra, state = size - old, {}
        for name in ("gate_proj", "up_proj"):
            w = getattr(mlp, name).weight.detach()
            state[f"midlayer.mlp.{name}.weight"] = torch.cat([w, random_like_rows(w, extra, generator)])
        down = mlp.down_proj.weight.detach()
        state["midlayer.mlp.down_proj.weight"] = torch.cat([down, down.new_zeros(down.shape[0], extra)], 1)
        return self.reshaped(state, intermediate_size=size)

    def one_layer(self, what: str) -> None:
        """Refuse `what` for a head of several layers (it reshapes or turns the midlayer alone)."""
        if self.cfg.layer.num_layers > 1:
            raise ValueError(f"{what}: the head has {self.cfg.layer.num_layers} layers (one-layer heads only)")

    def deepen(self, num_layers: int, generator: torch.Generator | None = None) -> "Eagle3Head":
        """This head with more decoder layers after its last (vLLM's layers.i) that computes exactly
        what this one does: each new layer's q/k/v and gate/up are random (at the scale of the
        midlayer's), its o_proj and down_proj zero, so it adds nothing to the residual stream until
        training grows it. A head of several layers loads in vLLM; SGLang runs later layers its own way."""
        c, old = self.cfg.layer, self.cfg.layer.num_layers
        if self.midlayer.self_attn.fused:
            raise ValueError("deepen: the head's projections are fused (inference only)")
        if num_layers < old:
            raise ValueError(f"deepen: {num_layers} layers are fewer than the head's {old}")
        att, mlp = self.midlayer.self_attn, self.midlayer.mlp
        state = {}
        for i in range(old, num_layers):
            p = f"layers.{i}."
            for name, like, shape in (("self_attn.q_proj", att.q_proj, (c.num_heads * c.head_dim, c.hidden_size)),
                                      ("self_attn.k_proj", att.k_proj, (c.num_kv_heads * c.head_dim, c.hidden_size)),
                                      ("self_attn.v_proj", att.v_proj, (c.num_kv_heads * c.head_dim, c.hidden_size)),
                                      ("mlp.gate_proj", mlp.gate_proj, (c.intermediate_size, c.hidden_size)),
                                      ("mlp.up_proj", mlp.up_proj, (c.intermediate_size, c.hidden_size))):
                w = like.weight.detach()
                state[p + name + ".weight"] = random_like_rows(w[:, :shape[1]], shape[0], generator)
            state[p + "self_attn.o_proj.weight"] = att.o_proj.weight.new_zeros(c.hidden_size, c.num_heads * c.head_dim)
            state[p + "mlp.down_proj.weight"] = mlp.down_proj.weight.new_zeros(c.hidden_size, c.intermediate_size)
            for name in ("input_layernorm", "post_attention_layernorm"):
                state[p + name + ".weight"] = torch.ones_like(self.norm.weight)
        return self.reshaped(state, num_layers=num_layers)

    def reshaped(self, weights: dict[str, torch.Tensor], **layer: int) -> "Eagle3Head":
        """This head with its layer's shape changed (`layer`: ModelConfig fields) and the given weights in
        place of its own (every other weight kept): what widen_mlp and widen_attention build."""
        new = Eagle3Head(replace(self.cfg, layer=self.cfg.layer.replace(**layer)))
        new = new.to(device=self.fc.weight.device, dtype=self.fc.weight.dtype)
        new.load_state_dict({**self.state_dict(), **weights})
        if self.cfg.shared_lm_head:
            new.share_lm_head(self.lm_head.weight)
        return new

    def widen_attention(self, num_heads: int, num_kv_heads: int,
                        generator: torch.Generator | None = None) -> "Eagle3Head":
        """This head with more query and key/value heads that computes exactly what this one does.
        Each old key/value head is copied num_kv_heads / old times; each old query head keeps its
        rows in a slot of one of its key/value head's copies, so it attends as before; the other
        slots get new query rows (random, at the scale of the old ones) whose o_proj columns are
        zero. Training starts from this head's function, the copies drift apart as their query heads
        pull them. The shape is in config.json (num_attention_heads, num_key_value_heads), which
        SGLang and vLLM read for a draft layer as for any Llama layer."""
        att, c = self.midlayer.self_attn, self.cfg.layer
        nh, nkv, d = c.num_heads, c.num_kv_heads, c.head_dim
        self.one_layer("widen_attention")
        if att.fused:
            raise ValueError("widen_attention: the head's projections are fused (inference only)")
        if num_kv_heads < nkv or num_kv_heads % nkv or num_heads % num_kv_heads or num_heads < nh:
            raise ValueError(f"widen_attention: {num_heads} query / {num_kv_heads} key-value heads do not hold "
                             f"the head's {nh} / {nkv} (key-value heads a multiple of {nkv}, query heads of those, "
                             f"no fewer query heads)")
        copies, g_old, g_new = num_kv_heads // nkv, nh // nkv, num_heads // num_kv_heads
        q = att.q_proj.weight.detach().view(nh, d, -1)
        o = att.o_proj.weight.detach().view(-1, nh, d)
        new_q = random_like_rows(att.q_proj.weight.detach(), num_heads * d, generator).view(num_heads, d, -1)
        new_o = o.new_zeros(o.shape[0], num_heads, d)
        for i in range(nh):  # old query head i, the u-th of its key/value head grp: copy u % copies of grp, slot u // copies
            grp, u = divmod(i, g_old)
            j = (grp * copies + u % copies) * g_new + u // copies
            new_q[j], new_o[:, j] = q[i], o[:, i]
        state = {"midlayer.self_attn.q_proj.weight": new_q.reshape(num_heads * d, -1),
                 "midlayer.self_attn.o_proj.weight": new_o.reshape(o.shape[0], num_heads * d)}
        for name in ("k_proj", "v_proj"):  # new key/value head j is a copy of old head j // copies
            w = getattr(att, name).weight.detach().view(nkv, d, -1)
            state[f"midlayer.self_attn.{name}.weight"] = w.repeat_interleave(copies, 0).reshape(num_kv_heads * d, -1)
        return self.reshaped(state, num_heads=num_heads, num_kv_heads=num_kv_heads)

    def with_vocab(self, ids: torch.Tensor, target_lm_head: torch.Tensor) -> "Eagle3Head":
        """This head over another draft vocabulary `ids` (sorted target ids): the lm_head rows of ids
        it has are kept; any other id's row is the target's output row for it, mapped into the head's
        space by a ridge fit of the head's rows to the target's rows on the ids it has, so a new token
        starts with logits of about the right scale, not at random. The ridge term (a tenth of the
        target rows' mean energy per dimension) keeps a head with few rows per dimension from fitting
        huge rows that would outvote every kept token. Every other weight is kept."""
        if self.cfg.shared_lm_head:
            raise ValueError("with_vocab: the head drafts through the target's output layer (the whole vocabulary)")
        old = self.draft_to_target()
        ids = ids.to(old.device)
        keep = torch.isin(ids, old)
        w = self.lm_head.weight.detach().float()
        t = target_lm_head.detach().float().to(w.device)
        gram = t[old].T @ t[old]
        ridge = 0.1 * gram.diagonal().mean() * torch.eye(len(gram), device=w.device)
        fit = torch.linalg.solve(gram + ridge, t[old].T @ w)  # (H_target, H): t[old] @ fit ≈ w
        rows = t[ids] @ fit
        rows[keep] = w[torch.isin(old, ids)]  # both sorted: the kept ids are in the same order in each
        new = Eagle3Head(replace(self.cfg, draft_vocab_size=len(ids)))
        new = new.to(device=w.device, dtype=self.fc.weight.dtype)
        state = {k: v for k, v in self.state_dict().items() if k not in ("lm_head.weight", "d2t")}
        state["lm_head.weight"], state["d2t"] = rows.to(self.lm_head.weight.dtype), new.d2t
        new.load_state_dict(state)
        new.set_vocab(ids)
        return new

    def share_lm_head(self, weight: torch.Tensor) -> None:
        """Draft through `weight` (V, H), the target's output layer, frozen: the head holds no output layer
        of its own (SGLang and vLLM load a checkpoint without lm_head.weight this way)."""
        assert self.cfg.shared_lm_head and weight.shape == self.lm_head.weight.shape
        self.lm_head.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)

    def with_shared_lm_head(self, weight: torch.Tensor) -> "Eagle3Head":
        """This head drafting over the whole vocabulary through the target's output layer `weight` (V, H):
        its own lm_head rows and vocabulary maps dropped, every other weight kept. The target's rows are
        not the head's, so its drafts start worse; eagle3_outmap.onto_target_output first turns the head
        toward them, and training does the rest."""
        cfg = replace(self.cfg, draft_vocab_size=len(self.t2d), shared_lm_head=True)
        with torch.device("meta"):
            new = Eagle3Head(cfg)
        new = new.to_empty(device=self.fc.weight.device).to(self.fc.weight.dtype)
        new.post_materialize()
        state = {k: v for k, v in self.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")}
        got = new.load_state_dict(state, strict=False)
        assert set(got.missing_keys) == {"lm_head.weight", "d2t", "t2d"} and not got.unexpected_keys, got
        new.set_vocab(torch.arange(cfg.draft_vocab_size, device=new.d2t.device))
        new.share_lm_head(weight)
        return new

    def fuse_projections(self) -> None:
        """For inference: q/k/v and gate/up each as one matmul (models.llama.fuse_linears), three
        fewer GEMMs per draft forward; the trainer keeps them apart."""
        for layer in (self.midlayer, *self.layers.values()):
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def post_materialize(self) -> None:
        self.inv_freq = rope_inv_freq(self.cfg.layer.rope, self.cfg.layer.head_dim).to(self.fc.weight.device)

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cache: Cache,
                meta: AttnMeta | None) -> torch.Tensor:
        """emb (B, T, H) token embeddings; hidden (B, T, H) already fused (`fc(taps)`) or the head's
        own previous output. Returns the last layer's output (B, T, H) before the final norm. In
        training `cache` is a TTTAttention (which needs no meta)."""
        out, residual = self.layer_stack(emb, hidden, positions, cache, meta)
        return out + residual

    def layer_stack(self, emb, hidden, positions, cache, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """The last layer's (MLP output, residual stream): every layer, the last residual add left to
        the caller (the final norm's kernel, in `step`)."""
        cos, sin = self.cos_sin(positions, self.inv_freq, emb.dtype)
        out, residual = self.midlayer(emb, hidden, cos, sin, cache, meta)
        for layer in self.layers.values():
            out, residual = layer(out, residual, cos, sin, cache, meta)
        return out, residual

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))  # (..., Vd)

    def step(self, emb: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cache: Cache,
             meta: AttnMeta) -> tuple[torch.Tensor, torch.Tensor]:
        """`logits(forward(...))` and the output, with the last residual add inside the final norm."""
        normed, h = self.norm(*self.layer_stack(emb, hidden, positions, cache, meta))
        return self.lm_head(normed), h

    def draft_to_target(self) -> torch.Tensor:
        """(Vd,) target id of each draft id."""
        return torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device) + self.d2t

    def set_vocab(self, draft_ids: torch.Tensor) -> None:
        """Use the given sorted target ids (Vd,) as the draft vocabulary (fills d2t and t2d)."""
        self.d2t.copy_(draft_ids.to(self.d2t) - torch.arange(len(draft_ids), device=self.d2t.device))
        self.t2d.zero_()
        self.t2d[draft_ids.to(self.t2d.device)] = True
