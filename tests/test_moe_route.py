"""The routing kernel (models/moe_route.py: the router's logits and the choice of experts in one Triton
kernel, on the GPU where there is one, else in Triton's interpreter) against torch's routing, and with
the post-attention RMSNorm inside it against llama.RMSNorm."""
import pytest
import torch

from eaglet.config import ModelConfig, MoEConfig, RopeConfig
from eaglet.models.moe import SparseMoE


@pytest.mark.parametrize("moe", [
    MoEConfig(8, 2, 16, True),  # Mixtral, Qwen3-MoE: softmax, renormalized
    MoEConfig(24, 6, 16, False, scaling=1.5),  # DeepSeek-V2 greedy: softmax, scaled
    MoEConfig(24, 4, 16, False, n_group=4, topk_group=2),  # DeepSeek-V2 group-limited
    MoEConfig(24, 4, 16, True, scoring="sigmoid", n_group=4, topk_group=2, group_top2=True, score_bias=True,
              scaling=2.5, router_fp32=True),  # DeepSeek-V3, Kimi-K2
], ids=["softmax", "softmax-scaled", "groups", "sigmoid-bias-groups-top2"])
@torch.inference_mode()
def test_routing_kernel_equals_the_torch_routing(moe):
    """The routing kernel (Triton: on the GPU where there is one, else in its interpreter; the router's
    logits and the choice in one kernel) chooses the experts torch's routing does, best first, with the same weights, for 1 to 24
    tokens, each token as it would alone, and leaves its counters at zero for the next call. Weights
    and inputs are multiples of 2^-10 of few bits, so every order of summing a logit gives it exactly: the
    spread's sin(10^4 x) would turn any rounding into other experts."""
    config = ModelConfig("deepseek_v3", 128, 64, 96, 2, 4, 4, 16, 1e-6, 256, RopeConfig(), moe=moe)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    layer = SparseMoE(config).eval().to(dev)
    g = torch.Generator().manual_seed(3)
    layer.gate.weight.copy_(torch.randint(-1000, 1001, (moe.num_experts, 64), generator=g) / 1024)
    if moe.score_bias:
        layer.gate.e_score_correction_bias.copy_(torch.rand(moe.num_experts, generator=g))
    for spread in (False, True):  # spread: the random shapes' scrambled logits
        layer.spread = spread
        for n in (1, 5, 24):
            x = (torch.randint(-64, 65, (n, 64), generator=g) / 1024).to(dev)
            (w, e), (kw, ke) = layer.route(x), layer.route(x, kernel=True)
            assert torch.equal(ke, e)
            assert (kw - w).abs().max() <= 1e-6 * w.abs().max()
            assert not layer.route_counts.any()
            alone = layer.route(x[-1:], kernel=True)
            assert torch.equal(alone[1], ke[-1:]) and torch.equal(alone[0], kw[-1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="Triton's interpreter truncates to bfloat16"))])
@torch.inference_mode()
def test_routing_kernel_with_the_norm_routes_the_normed_stream(dtype):
    """`route_normed` (the post-attention RMSNorm and its residual add inside the routing kernel): the
    stream x + residual as the add in x's dtype gives it, the normed input as RMSNorm gives it (to a
    rounding of x's dtype: the statistics sum in another order), and the experts and weights the
    routing gives that normed input, for 1 and 9 tokens, the counters at zero after."""
    from eaglet.models.llama import RMSNorm

    moe = MoEConfig(24, 4, 16, True)
    config = ModelConfig("qwen3_moe", 128, 64, 96, 2, 4, 4, 16, 1e-6, 256, RopeConfig(), moe=moe)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    layer = SparseMoE(config).eval().to(dev, dtype)
    norm = RMSNorm(64, 1e-6).to(dev, dtype)
    g = torch.Generator().manual_seed(6)
    layer.gate.weight.copy_(torch.randn(24, 64, generator=g))
    norm.weight.copy_(1 + torch.rand(64, generator=g))
    for n in (1, 9):
        x, residual = (torch.randn(n, 64, generator=g).to(dev, dtype) for _ in range(2))
        want, stream = norm(x, residual)
        got_x, got_stream, kw, ke = layer.route_normed(x, residual, norm.weight, norm.eps)
        assert torch.equal(got_stream, stream)
        tol = {torch.float32: 0, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}[dtype]  # one rounding at most
        assert ((got_x.float() - want.float()).abs() <= tol * want.float().abs() + 1e-5).all()
        w, e = layer.route(got_x, kernel=True)
        assert torch.equal(ke, e) and torch.equal(kw, w)
        assert not layer.route_counts.any()
