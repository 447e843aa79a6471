"""Random-weight models with the shapes of real ones, for the cost curves that need no trained
weights (decode rate against the bandwidth limit, verify time over token counts), and the bytes a
decode step must move."""
from __future__ import annotations

import torch

from ..config import MLAConfig, ModelConfig, MoEConfig, RopeConfig
from ..errors import InvalidInput
from ..kernels import Kernels
from ..models.llama import CausalLM, compile_elementwise
from ..models.moe import SparseMoE

SHAPES = {
    "llama-3.1-8b": ModelConfig(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, max_position=131072,
        rope=RopeConfig(theta=500000.0, kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                        original_max_position=8192)),
    "llama-3.1-70b": ModelConfig(
        model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
        num_heads=64, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, max_position=131072,
        rope=RopeConfig(theta=500000.0, kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                        original_max_position=8192)),
    "qwen3-8b": ModelConfig(
        model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, max_position=40960,
        rope=RopeConfig(theta=1000000.0), qk_norm=True),
    "smollm2-135m": ModelConfig(
        model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, max_position=8192,
        rope=RopeConfig(theta=100000.0), tie_embeddings=True),
    # Mixture-of-Experts shapes (their config.json files); the whole models
    "qwen3-30b-a3b": ModelConfig(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48,
        num_heads=32, num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6, max_position=40960,
        rope=RopeConfig(theta=1000000.0), qk_norm=True, moe=MoEConfig(128, 8, 768, True)),
    "qwen3-235b-a22b": ModelConfig(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=94,
        num_heads=64, num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6, max_position=40960,
        rope=RopeConfig(theta=1000000.0), qk_norm=True, moe=MoEConfig(128, 8, 1536, True)),
    "mixtral-8x7b": ModelConfig(
        model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, max_position=32768,
        rope=RopeConfig(theta=1000000.0), moe=MoEConfig(8, 2, 14336, True)),
    "deepseek-v2-lite": ModelConfig(
        model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944, num_layers=27,
        num_heads=16, num_kv_heads=16, head_dim=64, rms_norm_eps=1e-6, max_position=163840,
        rope=RopeConfig(theta=10000.0, kind="yarn", factor=40.0, original_max_position=4096, mscale=0.707,
                        mscale_all_dim=0.707),
        moe=MoEConfig(64, 6, 1408, False, dense_layers=(0,), shared_experts=2, router_fp32=True),
        mla=MLAConfig(None, 512, 128, 64, 128)),
    # Kimi-K2 (DeepSeek-V3's architecture at 384 experts), sliced: its dense first layer and three MoE
    # layers at full width (SLICES: the whole model's 61 layers, for totals computed per layer)
    "kimi-k2": ModelConfig(
        model_type="deepseek_v3", vocab_size=163840, hidden_size=7168, intermediate_size=18432, num_layers=4,
        num_heads=64, num_kv_heads=64, head_dim=64, rms_norm_eps=1e-6, max_position=131072,
        rope=RopeConfig(theta=50000.0, kind="yarn", factor=32.0, original_max_position=4096, mscale=1.0,
                        mscale_all_dim=1.0),
        moe=MoEConfig(384, 8, 2048, True, dense_layers=(0,), scoring="sigmoid", score_bias=True,
                      scaling=2.827, shared_experts=1, router_fp32=True),
        mla=MLAConfig(1536, 512, 128, 64, 128)),
}
# Kimi-K2.5's language model: Kimi-K2's architecture, its release keeping the routed experts INT4
SHAPES["kimi-k2.5"] = SHAPES["kimi-k2"]
SLICES = {"kimi-k2": 61, "kimi-k2.5": 61}  # a sliced shape -> the whole model's layer count
# routed experts as each release stores them (MoEConfig.stored), for the planner's bytes (perf/step_model.py):
# Kimi-K2's FP8 with a scale per 128 x 128 block, Kimi-K2.5's compressed-tensors INT4 packs with a bfloat16
# scale per 32 (their config.json quantization_config); the random-weight models keep every weight in one dtype
RELEASED = {"kimi-k2": ("fp8", 128), "kimi-k2.5": ("int4", 32)}


def random_model(name: str, device, dtype: torch.dtype, seed: int = 0, kernels: Kernels | None = None,
                 tp=None) -> CausalLM:
    """The named shape with N(0, 0.02) weights and unit norms, built directly on `device`, running
    `kernels` (default: the best the device has). MoE layers route their tokens as if uniformly
    (SparseMoE.route_spread): random weights alone would send every token to the same experts.
    With `tp` (dist/tp.py's TP), this rank's slice, its outputs summed over the ranks: every rank
    draws the same weights for its same-shaped tensors, so what all ranks hold whole (norms,
    routers, MLA's latent projections) agrees and every rank routes alike."""
    if name not in SHAPES:
        raise InvalidInput(f"unknown shape {name!r} (choose from {', '.join(SHAPES)})")
    kernels = Kernels.choose(device) if kernels is None else kernels
    config = SHAPES[name]
    if tp is not None and tp.world > 1:
        from ..dist.tp import local_config

        config = local_config(config, tp)
    with torch.device("meta"):
        model = CausalLM(config, kernels)
    model = model.to(dtype).to_empty(device=device)  # (in `dtype` from the start: Kimi-K2's slice is 107 GB)
    model.post_materialize()
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0) if pname.endswith("norm.weight") else p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.fuse_projections()
    for m in model.modules():
        if isinstance(m, SparseMoE):
            m.route_spread()
    if tp is not None and tp.world > 1:
        from ..dist.tp import all_reduce_outputs

        all_reduce_outputs(model)
    if kernels.compile:
        compile_elementwise(model)
    return model.eval().requires_grad_(False)


def weight_bytes(model: CausalLM) -> int:
    """Bytes of every weight, each tensor once (tied weights share storage; on the meta device,
    where nothing has an address, they share the Parameter)."""
    seen, total = set(), 0
    for p in model.parameters():
        key = id(p) if p.device.type == "meta" else p.data_ptr()
        if key not in seen:
            seen.add(key)
            total += p.numel() * p.element_size()
    return total


def decode_bytes(model: CausalLM, context: int = 0, tokens: int = 1, experts: float | None = None) -> int:
    """Bytes a batch-1 forward of `tokens` tokens must read: every weight once (the input embedding
    table only when tied to the output head, since a lookup reads one row; of the routed experts
    only those the tokens are expected to touch, `touched_experts`, or `experts` a layer where
    measured; of an expert-parallel rank's share, its expected part of them: the mean rank's, where
    the planner's step model takes the busiest rank's), plus the cache of `context` tokens (K and V,
    or MLA's latents)."""
    c = model.config
    total = weight_bytes(model)
    if not c.tie_embeddings:
        emb = model.model.embed_tokens.weight
        total -= emb.numel() * emb.element_size()
    size = next(model.parameters()).element_size()
    for layer in model.model.layers:
        if isinstance(layer.ffn, SparseMoE):
            moe = c.moe
            per_expert = sum(lin.weight.numel() for lin in layer.ffn.experts[0].linears()) * size
            held = layer.ffn.held  # all E, or E / N under expert parallelism
            touched = held / moe.num_experts * touched_experts(moe.num_experts, moe.top_k, tokens) \
                if experts is None else experts
            total -= round((held - touched) * per_expert)
    per_token = c.mla.width if c.mla is not None else 2 * c.num_kv_heads * c.head_dim
    return total + c.num_layers * per_token * context * size


def touched_experts(experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts `tokens` tokens route to, expected under uniform routing: E(1 - (1 - k/E)^T)."""
    return experts * (1 - (1 - top_k / experts) ** tokens)


def copy_bandwidth(device, nbytes: int = 1 << 30, repeats: int = 20) -> float:
    """Measured device memory bandwidth in bytes/s: a large device-to-device copy reads and writes
    every byte (median over repeats, after a warm-up)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    times.sort()
    return 2 * nbytes / times[len(times) // 2]


def random_head(model: CausalLM, seed: int = 0):
    """An untrained EAGLE-3 head for `model`: its layer's shape, a draft vocabulary of the first
    32,000 ids (or all), built on the model's device in its dtype and running its kernels."""
    from ..spec.drafters.eagle3_head import Eagle3Config, Eagle3Head

    p = next(model.parameters())
    vocab = min(32000, model.config.vocab_size)
    torch.manual_seed(seed)
    with torch.device(p.device):
        head = Eagle3Head(Eagle3Config.for_target(model.config, draft_vocab_size=vocab), model.kernels)
        head.set_vocab(torch.arange(vocab))
    head = head.to(p.dtype)
    head.fuse_projections()
    if model.kernels.compile:
        compile_elementwise(head)
    return head.eval().requires_grad_(False)
