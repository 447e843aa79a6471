"""The cost of one forward of T tokens (a decode at T = 1, a verify of T draft nodes) on one
tensor-parallel deployment, from first principles: the bytes a rank must read over its GPU's
bandwidth at a measured efficiency, the all-reduces over its link, and a fixed per-step cost.

    t(T) = bytes(T) / (bandwidth x efficiency) + 2 x layers x allreduce(T x hidden x 2 bytes) + fixed
                                                                               (+ verify_fixed where T > 1)

With a measured rate for the routed experts (`moe_rate`: the fused MoE kernels' GB/s at each token
count, from an `eaglet bench-moe` record), the routed bytes are timed at that rate and the rest at the
efficiency: the kernels read experts near the copy rate, a decode's other matmuls well below it.

A rank's bytes (batch 1, weights in bfloat16 but the routed experts, which read as stored):
  attention: heads split over the ranks (MLA's latent projections q_a / kv_a whole on every rank,
    as vLLM and SGLang hold them); KV heads split, or one a rank where there are fewer than ranks
  dense MLPs and shared experts: split by width
  routed experts: of each MoE layer, the distinct experts T tokens route to, k + s(E(1 - (1-k/E)^T) - k)
    with s = 1 for uniform routing (`spread` < 1 where tokens share experts more, as measured by the
    MoE counters); each expert split by width, so a rank reads 1/N of every touched expert; or under
    expert parallelism (`moe_split` "ep") each rank holds E/N experts whole and the step waits for
    the busiest: the expected most distinct experts one rank's E/N are touched by (`busiest_rank`)
  norms and routers: whole on every rank
  output layer: vocabulary-parallel (split over the ranks, as vLLM and SGLang do); the input embedding
    is a lookup of T rows, not counted (as shapes.decode_bytes)
  cache: K and V of the rank's KV heads, or MLA's latent (every rank holds it whole), at `context`
Left to the fixed costs: a forward of several tokens runs other matmul and attention paths than a
one-token decode (tensor-core tiles instead of GEMV, a mask, copies), a step of cost `verify_fixed`
that a measured verify solves; the vocabulary-parallel embedding's all-reduce and the logits' gather (one each
a step), kernel launches and host work. FLOPs are not modelled: at the token counts of a verify a step
is bound by its bytes. Given a measured decode step, `calibrated` solves the fixed cost from it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..config import ModelConfig
from .hardware import GPU, Link
from .shapes import touched_experts

BF16 = 2


def bytes_per_param(stored: tuple[str, int] | None) -> float:
    """A routed expert's bytes a weight as stored: bfloat16; INT4 packs with a bfloat16 scale per group
    of g; FP8 with a float32 scale per b x b block."""
    if stored is None:
        return BF16
    kind, n = stored
    return 0.5 + BF16 / n if kind == "int4" else 1 + 4 / (n * n)


@dataclass(frozen=True)
class Deployment:
    config: ModelConfig  # the whole model (all its layers)
    tp: int
    gpu: GPU
    efficiency: float  # fraction of the GPU's peak bandwidth a step reads at
    link: Link | None = None  # the all-reduce model, unless `comm` (a measured curve) is given
    comm: object | None = None  # dist.comm_curve.AllReduceCurve
    experts: tuple[str, int] | None = None  # routed experts as stored: ("int4", group), ("fp8", block); None bf16
    context: int = 1024  # tokens in the cache
    spread: float = 1.0  # distinct experts beyond a token's k, as a fraction of uniform routing's
    fixed_ms: float = 0.0
    moe_split: str = "tp"  # routed experts split by width ("tp") or whole, E/N a rank ("ep")
    moe_rate: tuple[tuple[int, float], ...] | None = None  # (tokens, GB/s) the MoE kernels read experts at
    verify_fixed_ms: float = 0.0  # what a forward of T > 1 tokens adds to the fixed cost

    def allreduce_us(self, nbytes: float) -> float:
        if self.tp == 1:
            return 0.0
        return self.comm.latency_us(nbytes) if self.comm is not None else self.link.allreduce_us(self.tp, nbytes)


@dataclass(frozen=True)
class StepBytes:
    """One rank's bytes for a forward of `tokens` tokens, by part."""
    tokens: int
    experts: float  # distinct routed experts an MoE layer reads
    attention: float
    mlp: float  # dense MLP layers
    shared: float  # shared experts
    routed: float
    norms_routers: float
    head: float  # output layer and final norm
    cache: float

    @property
    def total(self) -> float:
        return (self.attention + self.mlp + self.shared + self.routed + self.norms_routers + self.head
                + self.cache)


def distinct_experts(d: Deployment, tokens: int) -> float:
    m = d.config.moe
    return m.top_k + d.spread * (touched_experts(m.num_experts, m.top_k, tokens) - m.top_k)


def busiest_rank(experts: int, ranks: int, touched: float) -> float:
    """The expected largest number of distinct experts any one of `ranks` ranks reads, each holding
    experts / ranks of them, when `touched` of the `experts` are read, each alike likely: the largest
    of `ranks` counts Binomial(experts / ranks, touched / experts) (taken as independent), by
    E[max] = sum over m >= 1 of 1 - P(count < m)^ranks."""
    from math import comb

    held, p = experts // ranks, min(1.0, touched / experts)
    pmf = [comb(held, i) * p ** i * (1 - p) ** (held - i) for i in range(held + 1)]
    below, out = 0.0, 0.0
    for m in range(1, held + 1):
        below += pmf[m - 1]
        out += 1 - min(1.0, below) ** ranks
    return out


def step_bytes(d: Deployment, tokens: int) -> StepBytes:
    c, n = d.config, d.tp
    h = c.hidden_size
    attn = norms = mlp = shared = routed = 0.0
    experts = distinct_experts(d, tokens) if c.moe is not None else 0.0
    # whole experts a rank reads (EP: its busiest rank's), or expert-equivalents (TP: 1/N of each)
    per_rank = busiest_rank(c.moe.num_experts, n, experts) if c.moe is not None and d.moe_split == "ep" and n > 1 \
        else experts / n
    for layer in range(c.num_layers):
        attn += attention_params(c, n)
        norms += 2 * h
        if c.moe is not None and c.moe.sparse(layer):
            m = c.moe
            norms += h * m.num_experts  # the router
            shared += 3 * h * m.expert_size * m.shared_experts / n
            routed += per_rank * 3 * h * m.expert_size * bytes_per_param(d.experts) / BF16
        else:
            mlp += 3 * h * c.intermediate_size / n + ((2 * c.intermediate_size + h) / n if c.mlp_bias else 0)
    head = c.vocab_size * h / n + h
    return StepBytes(tokens, experts, BF16 * attn, BF16 * mlp, BF16 * shared, BF16 * routed, BF16 * norms,
                     BF16 * head, BF16 * cache_values(c, n, d.context))


def attention_params(c: ModelConfig, n: int) -> float:
    """One layer's attention weights a rank holds (split ones / n, whole ones whole)."""
    h, nh = c.hidden_size, c.num_heads
    if c.mla is not None:
        m = c.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        bias = m.kv_lora_rank + m.qk_rope_head_dim if c.qkv_bias else 0
        if m.q_lora_rank is None:
            q = h * nh * qk / n
        else:
            q = h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * nh * qk / n + (m.q_lora_rank if c.qkv_bias else 0)
        kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank + bias
        return q + kv + m.kv_lora_rank * nh * (m.qk_nope_head_dim + m.v_head_dim) / n + (nh * m.v_head_dim * h + (
            h if c.o_bias else 0)) / n
    d = c.head_dim
    nkv = kv_heads(c, n)
    q = (h + (1 if c.qkv_bias else 0)) * nh * d / n
    kv = 2 * (h + (1 if c.qkv_bias else 0)) * nkv * d
    o = (nh * d * h + (h if c.o_bias else 0)) / n
    return q + kv + o + (2 * d if c.qk_norm else 0)


def kv_heads(c: ModelConfig, n: int) -> float:
    """KV heads a rank holds: its share, or one where there are fewer KV heads than ranks."""
    return c.num_kv_heads / n if n <= c.num_kv_heads else 1


def cache_values(c: ModelConfig, n: int, context: int) -> float:
    per_token = c.mla.width if c.mla is not None else 2 * kv_heads(c, n) * c.head_dim
    return c.num_layers * per_token * context


@dataclass(frozen=True)
class StepTime:
    tokens: int
    bytes: StepBytes
    bytes_ms: float
    comm_ms: float
    fixed_ms: float

    @property
    def ms(self) -> float:
        return self.bytes_ms + self.comm_ms + self.fixed_ms


def moe_gb_s(rate: tuple[tuple[int, float], ...], tokens: int) -> float:
    """The measured rate at `tokens`, linear in log2(tokens) between the measured counts, the nearest
    one outside them."""
    from math import log2

    pts = sorted(rate)
    if tokens <= pts[0][0]:
        return pts[0][1]
    for (t0, r0), (t1, r1) in zip(pts, pts[1:]):
        if tokens <= t1:
            w = (log2(tokens) - log2(t0)) / (log2(t1) - log2(t0))
            return r0 + w * (r1 - r0)
    return pts[-1][1]


def step_time(d: Deployment, tokens: int) -> StepTime:
    b = step_bytes(d, tokens)
    rate = d.gpu.bandwidth_gb_s * 1e9 * d.efficiency
    if d.moe_rate is not None and b.routed:
        bytes_ms = ((b.total - b.routed) / rate + b.routed / (moe_gb_s(d.moe_rate, tokens) * 1e9)) * 1e3
    else:
        bytes_ms = b.total / rate * 1e3
    comm_ms = 2 * d.config.num_layers * d.allreduce_us(tokens * d.config.hidden_size * BF16) / 1e3
    return StepTime(tokens, b, bytes_ms, comm_ms, d.fixed_ms + (d.verify_fixed_ms if tokens > 1 else 0.0))


def calibrated(d: Deployment, decode_ms: float) -> tuple[Deployment, float]:
    """The deployment with its fixed per-step cost solved from a measured decode step, and the raw
    difference (measured - bytes time - all-reduces; negative where the model alone exceeds the
    measurement, the fixed cost then 0). (What a verify adds, `verify_fixed_ms`, is solved from a
    measured verify where one is given: plan_validate.py.)"""
    t = step_time(dataclasses.replace(d, fixed_ms=0.0), 1)
    left = decode_ms - t.bytes_ms - t.comm_ms
    return dataclasses.replace(d, fixed_ms=max(0.0, left)), left


def drafter_ms(d: Deployment, draft_vocab: int = 32000) -> float:
    """One draft step of an EAGLE-3 head shaped for this target (Eagle3Config.for_target: one dense
    Llama layer of the target's width and heads, its attention reading [embedding, hidden], an fc from
    the three tapped layers, an output layer over a draft vocabulary of `draft_vocab` as the published
    heads use), split over the ranks like the target, one token: its bytes at this GPU and its two
    all-reduces; no fixed cost (launches and host work are not counted)."""
    from ..spec.drafters.eagle3_head import Eagle3Config

    c, n = d.config, d.tp
    cfg = Eagle3Config.for_target(c, draft_vocab_size=min(draft_vocab, c.vocab_size))
    layer = cfg.layer
    h = layer.hidden_size
    attn = (2 * h * (layer.num_heads / n + 2 * kv_heads(layer, n)) + layer.num_heads * h / n) * layer.head_dim
    params = (3 * cfg.target_hidden_size * h / n  # fc
              + attn + 3 * h * layer.intermediate_size / n + cfg.draft_vocab_size * h / n)
    bytes_ms = BF16 * params / (d.gpu.bandwidth_gb_s * 1e9 * d.efficiency) * 1e3
    return bytes_ms + 2 * d.allreduce_us(h * BF16) / 1e3
