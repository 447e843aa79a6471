"""Model configuration: one frozen dataclass for the whole Llama family and its Mixture-of-Experts
members (Qwen3-MoE, Mixtral: `MoEConfig`), built once from a HF config.json dict (transformers 4.x `rope_theta`/`rope_scaling` or 5.x `rope_parameters`).

GGUF metadata is first turned into the same HF dict (weights/gguf_file.py), so there is one parser.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelLoadError

# model_type -> the switches that differ between family members (defaults; config keys win)
# model_type -> how its attention biases and q/k norm are set (as in transformers' modeling files):
# "cfg" means the config's attention_bias decides, True/False are fixed by the family.
FAMILY = {
    "llama": dict(qkv_bias="cfg", o_bias="cfg", mlp_bias="cfg", qk_norm=False, sliding=False),
    "mistral": dict(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False, sliding=True),
    "qwen2": dict(qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False, sliding=False),
    "qwen3": dict(qkv_bias="cfg", o_bias="cfg", mlp_bias=False, qk_norm=True, sliding=False),
    "qwen3_moe": dict(qkv_bias="cfg", o_bias="cfg", mlp_bias=False, qk_norm=True, sliding=False),
    "mixtral": dict(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False, sliding=True),
    "deepseek_v2": dict(qkv_bias="cfg", o_bias="cfg", mlp_bias=False, qk_norm=False, sliding=False),
    "deepseek_v3": dict(qkv_bias="cfg", o_bias="cfg", mlp_bias=False, qk_norm=False, sliding=False),
}
ALIASES = {"kimi_k2": "deepseek_v3"}  # Kimi-K2's config: DeepSeek-V3's architecture under its own name
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                 "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head Latent Attention (models/mla.py): queries through a low-rank bottleneck (or
    directly when q_lora_rank is None), keys and values from one latent per token."""
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True  # the rotary dims in interleaved pairs (DeepSeek's checkpoints)

    @property
    def width(self) -> int:
        """Values the latent cache keeps per token and layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @staticmethod
    def from_hf(mt: str, cfg: dict) -> "MLAConfig | None":
        if mt not in ("deepseek_v2", "deepseek_v3"):
            return None
        q = cfg.get("q_lora_rank")
        return MLAConfig(None if q is None else int(q), int(cfg["kv_lora_rank"]), int(cfg["qk_nope_head_dim"]),
                         int(cfg["qk_rope_head_dim"]), int(cfg["v_head_dim"]),
                         mt == "deepseek_v2" or bool(cfg.get("rope_interleave", True)))

    def to_hf(self) -> dict:
        return dict(q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank,
                    qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
                    v_head_dim=self.v_head_dim, rope_interleave=self.rope_interleave)


@dataclass(frozen=True)
class MoEConfig:
    """The routed experts of a Mixture-of-Experts model (models/moe.py) and how tokens are routed:
    softmax over the router's logits (Qwen3-MoE, Mixtral, DeepSeek-V2) or sigmoid with a learned
    bias on the choice only (DeepSeek-V3); optionally within the best `topk_group` of `n_group`
    expert groups first (a group scored by its best expert, or by its best two for DeepSeek-V3)."""
    num_experts: int
    top_k: int
    expert_size: int  # each expert's intermediate width
    norm_topk_prob: bool  # the top-k routing weights renormalized to sum to 1
    sparse_step: int = 1  # every sparse_step-th layer is sparse (Qwen's decoder_sparse_step)
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP all the same (Qwen's mlp_only_layers,
    # DeepSeek's first_k_dense_replace)
    scoring: str = "softmax"  # softmax | sigmoid
    n_group: int = 1
    topk_group: int = 1
    group_top2: bool = False  # a group's score: its best two experts' sum (DeepSeek-V3), else its best
    score_bias: bool = False  # e_score_correction_bias added to the scores for the choice (DeepSeek-V3)
    scaling: float = 1.0  # routed_scaling_factor
    shared_experts: int = 0  # n_shared_experts: one dense MLP of shared_experts x expert_size beside
    router_fp32: bool = False  # the router's logits in float32 whatever the model's dtype (DeepSeek)
    stored: tuple[str, int] | None = None  # routed experts kept quantized: ("int4", group) or ("fp8", block)
    # expert parallelism (dist/tp.py): the routed experts this rank holds, (first, count), None: all of them;
    # and its slice of the shared experts' width, None: shared_experts x expert_size
    local_experts: tuple[int, int] | None = None
    shared_width: int | None = None

    def sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers and (layer + 1) % self.sparse_step == 0

    @staticmethod
    def from_hf(mt: str, cfg: dict) -> "MoEConfig | None":
        if mt == "mixtral":  # every layer sparse; the experts' width is intermediate_size
            return MoEConfig(int(cfg["num_local_experts"]), int(cfg["num_experts_per_tok"]),
                             int(cfg["intermediate_size"]), True)
        experts = int(cfg.get("num_experts") or cfg.get("n_routed_experts") or cfg.get("num_local_experts")
                      or 0)  # transformers 5 writes the last
        if mt in ("deepseek_v2", "deepseek_v3"):
            v3 = mt == "deepseek_v3"
            method = cfg.get("topk_method", "noaux_tc" if v3 else "greedy")
            if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
                raise ModelLoadError(f"{mt}: topk_method {method!r} is not supported")
            grouped = method != "greedy"
            if int(cfg.get("moe_layer_freq", 1)) != 1:
                raise ModelLoadError(f"{mt}: moe_layer_freq {cfg['moe_layer_freq']} is not supported (1)")
            return MoEConfig(experts, int(cfg["num_experts_per_tok"]), int(cfg["moe_intermediate_size"]),
                             bool(cfg.get("norm_topk_prob", v3)),
                             1, tuple(range(int(cfg.get("first_k_dense_replace", 0)))),
                             "sigmoid" if v3 else "softmax", int(cfg.get("n_group") or 1) if grouped else 1,
                             int(cfg.get("topk_group") or 1) if grouped else 1, v3, v3,
                             float(cfg.get("routed_scaling_factor", 1.0)), int(cfg.get("n_shared_experts") or 0),
                             True)
        if mt == "qwen3_moe" and experts > 0:
            return MoEConfig(experts, int(cfg["num_experts_per_tok"]),
                             int(cfg["moe_intermediate_size"]), bool(cfg.get("norm_topk_prob", False)),
                             int(cfg.get("decoder_sparse_step", 1)), tuple(cfg.get("mlp_only_layers") or ()))
        return None

    def to_hf(self, mt: str) -> dict:
        if mt in ("deepseek_v2", "deepseek_v3"):
            method = "noaux_tc" if mt == "deepseek_v3" else "group_limited_greedy" if self.n_group > 1 else "greedy"
            return dict(n_routed_experts=self.num_experts, num_experts_per_tok=self.top_k,
                        moe_intermediate_size=self.expert_size, norm_topk_prob=self.norm_topk_prob,
                        first_k_dense_replace=len(self.dense_layers), topk_method=method, n_group=self.n_group,
                        topk_group=self.topk_group, routed_scaling_factor=self.scaling,
                        n_shared_experts=self.shared_experts)
        if mt == "mixtral":
            return dict(num_local_experts=self.num_experts, num_experts_per_tok=self.top_k)
        return dict(num_experts=self.num_experts, num_experts_per_tok=self.top_k,
                    moe_intermediate_size=self.expert_size, norm_topk_prob=self.norm_topk_prob,
                    decoder_sparse_step=self.sparse_step, mlp_only_layers=list(self.dense_layers))


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # default | linear | llama3 | yarn
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    # YaRN (DeepSeek-V2/V3, Kimi-K2): the ramp between interpolated and extrapolated frequencies, and
    # the magnitude corrections (of cos/sin, and with mscale_all_dim of DeepSeek's softmax scale)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True

    def cos_sin_scale(self) -> float:
        """What cos and sin are multiplied by (YaRN's attention factor; 1 otherwise)."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    def softmax_scale(self) -> float:
        """DeepSeek's factor on 1/sqrt(head dim) under YaRN with mscale_all_dim (1 otherwise)."""
        if self.kind == "default" or not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2

    @staticmethod
    def from_hf(cfg: dict) -> "RopeConfig":
        params = dict(cfg.get("rope_parameters") or {})
        params.update(cfg.get("rope_scaling") or {})
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        kind = params.get("rope_type", params.get("type", "default")) or "default"
        if kind not in ("default", "linear", "llama3", "yarn"):
            raise ModelLoadError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3, yarn)")
        original = params.get("original_max_position_embeddings", 8192)
        factor = params.get("factor")
        if factor is None and kind == "yarn":  # DeepSeek-V3's convention: the ratio to the pretrained length
            factor = int(cfg.get("max_position_embeddings", original)) / int(original)
        get = lambda k, d: d if params.get(k) is None else float(params[k])  # noqa: E731
        return RopeConfig(
            theta=theta,
            kind=kind,
            factor=float(1.0 if factor is None else factor),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position=int(original),
            beta_fast=get("beta_fast", 32.0), beta_slow=get("beta_slow", 1.0), mscale=get("mscale", 0.0),
            mscale_all_dim=get("mscale_all_dim", 0.0),
            attention_factor=None if params.get("attention_factor") is None else float(params["attention_factor"]),
            truncate=bool(params.get("truncate", True)),
        )

    def to_hf(self) -> dict:
        if self.kind == "default":
            return {"rope_theta": self.theta}
        scaling = {"rope_type": self.kind, "factor": self.factor}
        if self.kind == "yarn":
            scaling.update(original_max_position_embeddings=self.original_max_position, beta_fast=self.beta_fast,
                           beta_slow=self.beta_slow, mscale=self.mscale, mscale_all_dim=self.mscale_all_dim,
                           attention_factor=self.attention_factor, truncate=self.truncate)
        if self.kind == "llama3":
            scaling.update(low_freq_factor=self.low_freq_factor, high_freq_factor=self.high_freq_factor,
                           original_max_position_embeddings=self.original_max_position)
        return {"rope_theta": self.theta, "rope_scaling": scaling}


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    rope: RopeConfig
    tie_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    moe: MoEConfig | None = None  # routed experts (Qwen3-MoE, Mixtral, DeepSeek); None: dense
    mla: MLAConfig | None = None  # latent attention (DeepSeek); head_dim is then its rotary part
    # vocabulary-parallel (dist/vocab.py): the (first, count) rows of the embedding and output layer
    # this rank holds; None: all vocab_size of them
    vocab_slice: tuple[int, int] | None = None
    # on a tensor-parallel rank's slice (dist/tp.py): the whole model's config (drafters are shaped by it)
    whole: "ModelConfig | None" = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"num_attention_heads {self.num_heads} is not a multiple of "
                                 f"num_key_value_heads {self.num_kv_heads}")

    @property
    def vocab_rows(self) -> int:
        """Rows of the embedding and output layer this model holds: all, or its vocabulary slice's."""
        return self.vocab_size if self.vocab_slice is None else self.vocab_slice[1]

    @property
    def default_eagle_layers(self) -> tuple[int, int, int]:
        """Layers whose *input* residual stream EAGLE-3 taps: 2, N//2, N-3 (see docs/eagle3.md)."""
        n = self.num_layers
        return (2, n // 2, n - 3)

    @staticmethod
    def from_hf(cfg: dict) -> "ModelConfig":
        mt = cfg.get("model_type")
        mt = ALIASES.get(mt, mt)
        if mt not in FAMILY and isinstance(cfg.get("text_config"), dict):  # a multimodal wrapper (Kimi-K2.5)
            return ModelConfig.from_hf(text_config(cfg))
        if mt not in FAMILY:
            archs = cfg.get("architectures") or []
            raise ModelLoadError(f"unsupported model_type {mt!r} {archs} (supported: {', '.join(FAMILY)})")
        try:
            h, nh = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            eos = cfg.get("eos_token_id")
            eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
            fam = FAMILY[mt]
            sw = cfg.get("sliding_window") if fam["sliding"] else None
            if cfg.get("use_sliding_window") and not fam["sliding"]:
                raise ModelLoadError(f"{mt}: use_sliding_window (per-layer windows) is not supported")

            mla = MLAConfig.from_hf(mt, cfg)

            def switch(key: str, cfg_key: str) -> bool:
                return bool(cfg.get(cfg_key, False)) if fam[key] == "cfg" else fam[key]
            return ModelConfig(
                model_type=mt,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=h,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=nh,
                num_kv_heads=int(cfg.get("num_key_value_heads") or nh),
                head_dim=mla.qk_rope_head_dim if mla else int(cfg.get("head_dim") or h // nh),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                max_position=int(cfg.get("max_position_embeddings", 4096)),
                rope=RopeConfig.from_hf(cfg),
                tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=switch("qkv_bias", "attention_bias"),
                o_bias=switch("o_bias", "attention_bias"),
                mlp_bias=switch("mlp_bias", "mlp_bias"),
                qk_norm=fam["qk_norm"],
                sliding_window=int(sw) if sw else None,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos,
                moe=MoEConfig.from_hf(mt, cfg),
                mla=mla,
            )
        except KeyError as e:
            raise ModelLoadError(f"config.json lacks {e.args[0]!r}") from None

    @staticmethod
    def from_file(path: str | Path) -> "ModelConfig":
        try:
            return ModelConfig.from_hf(json.loads(Path(path).read_text()))
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{path}: not valid JSON ({e})") from None

    def to_hf(self) -> dict:
        """A HF config.json dict that `from_hf` reads back to an equal config."""
        d = dict(
            architectures=[ARCHITECTURES[self.model_type]],
            model_type=self.model_type, vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position, tie_word_embeddings=self.tie_embeddings,
            attention_bias=self.qkv_bias, mlp_bias=self.mlp_bias,
            sliding_window=self.sliding_window,
            bos_token_id=self.bos_token_id,
            eos_token_id=list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
        )
        d.update(self.rope.to_hf())
        if self.moe is not None:
            d.update(self.moe.to_hf(self.model_type))
        if self.mla is not None:
            d.update(self.mla.to_hf())
        return d

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)


def rope_inv_freq(rope: RopeConfig, head_dim: int):
    """Inverse frequencies (head_dim/2,) including linear and llama3 scaling, in float32."""
    import torch

    # float32 throughout, the way transformers computes it, so logits match to the last bit we can
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.kind == "linear":
        inv = inv / rope.factor
    elif rope.kind == "yarn":  # extrapolated (high) frequencies blended into interpolated (low) ones on a ramp
        def dim_of(rotations: float) -> float:
            return head_dim * math.log(rope.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))
        low, high = dim_of(rope.beta_fast), dim_of(rope.beta_slow)
        if rope.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
        extrapolate = 1 - ramp
        inv = inv / rope.factor * (1 - extrapolate) + inv * extrapolate
    elif rope.kind == "llama3":
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    return inv.float()


def text_config(cfg: dict) -> dict:
    """The language model's config inside a multimodal wrapper's (its `text_config`; token ids the
    wrapper sets apply), or the config itself."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        return cfg
    ids = {k: cfg[k] for k in ("bos_token_id", "eos_token_id") if cfg.get(k) is not None and k not in text}
    return {**text, **ids}


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


SPEC_METHODS = ("eagle3", "ngram", "draft")


@dataclass(frozen=True)
class SpecConfig:
    """Speculation settings, named like SGLang's flags. topk == 1 is a chain of `steps` drafts;
    topk > 1 is the EAGLE-2 dynamic tree: depth `steps`, `topk` children per expanded node, the
    best `draft_tokens - 1` nodes (plus the root) verified."""

    method: str = "eagle3"
    draft: str | None = None  # drafter checkpoint (eagle3) or model (draft); None = bundled default
    steps: int = 5
    topk: int = 1
    draft_tokens: int | None = None  # verify budget including the root; None = steps + 1 for a chain
    ngram_max: int = 4  # longest suffix the n-gram drafter matches
    ngram_min: int = 1

    def __post_init__(self):
        from .errors import InvalidInput

        if self.method not in SPEC_METHODS:
            raise InvalidInput(f"--spec must be one of {', '.join(SPEC_METHODS)}, got {self.method!r}")
        for name in ("steps", "topk"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise InvalidInput(f"--spec-{name} must be a positive integer, got {v}")
        if self.steps > 32:
            raise InvalidInput(f"--spec-steps {self.steps} is beyond any useful depth (at most 32)")
        if self.draft_tokens is None:
            if self.topk > 1:
                raise InvalidInput("a tree (--spec-topk > 1) needs --spec-draft-tokens (the verify budget)")
            object.__setattr__(self, "draft_tokens", self.steps + 1)
        n, most = self.draft_tokens, 1 + self.topk + (self.steps - 1) * self.topk ** 2
        if not isinstance(n, int) or n < self.steps + 1:
            raise InvalidInput(f"--spec-draft-tokens {n} is smaller than the tree needs: {self.steps} steps "
                               f"need at least {self.steps + 1} tokens (root included)")
        if self.topk == 1 and n != self.steps + 1:
            raise InvalidInput(f"a chain of {self.steps} steps verifies exactly {self.steps + 1} tokens, "
                               f"not --spec-draft-tokens {n}")
        if n > most:
            raise InvalidInput(f"--spec-draft-tokens {n} exceeds the {most} nodes a tree of depth "
                               f"{self.steps} and top-k {self.topk} can draft")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise InvalidInput(f"n-gram sizes must satisfy 1 <= min <= max, got {self.ngram_min}, {self.ngram_max}")

    @property
    def is_chain(self) -> bool:
        return self.topk == 1
