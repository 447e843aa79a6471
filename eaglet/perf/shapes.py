"""Random-weight models with the shapes of real ones, for the cost curves that need no trained
weights (decode rate against the bandwidth limit, verify time over token counts), and the bytes a
decode step must move."""
from __future__ import annotations

import torch

from ..config import ModelConfig, RopeConfig
from ..errors import InvalidInput
from ..kernels import Kernels
from ..models.llama import CausalLM, compile_elementwise

SHAPES = {
    "llama-3.1-8b": ModelConfig(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, max_position=131072,
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
}


def random_model(name: str, device, dtype: torch.dtype, seed: int = 0, kernels: Kernels | None = None) -> CausalLM:
    """The named shape with N(0, 0.02) weights and unit norms, built directly on `device`, running
    `kernels` (default: the best the device has)."""
    if name not in SHAPES:
        raise InvalidInput(f"unknown shape {name!r} (choose from {', '.join(SHAPES)})")
    kernels = Kernels.choose(device) if kernels is None else kernels
    with torch.device("meta"):
        model = CausalLM(SHAPES[name], kernels)
    model = model.to_empty(device=device).to(dtype)
    model.post_materialize()
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0) if pname.endswith("norm.weight") else p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.fuse_projections()
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


def decode_bytes(model: CausalLM, context: int = 0) -> int:
    """Bytes one batch-1 decode step must read: every weight once (the input embedding table only
    when tied to the output head, since a lookup reads one row), plus K and V of `context` tokens."""
    c = model.config
    total = weight_bytes(model)
    if not c.tie_embeddings:
        emb = model.model.embed_tokens.weight
        total -= emb.numel() * emb.element_size()
    kv = 2 * c.num_layers * c.num_kv_heads * c.head_dim * context * next(model.parameters()).element_size()
    return total + kv


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
