"""The MLA attention kernel (models/mla_attention.py), on the CPU through Triton's interpreter (float16):
it stores each new token's latent-cache entry (kv_a_layernorm's latent, the rotated key) where the
general path stores it and attends like the absorbed form over the cached entries and the new ones
(causal, or a tree mask with pending levels), in one split and in several, in one tile of query
rows and in several, with DeepSeek's interleaved rotary pairs and without; a tiny DeepSeek-V3 model
decoding and verifying a tree with it matches the general path."""
import pytest
import torch

from eaglet.kernels import Kernels
from eaglet.models import mla_attention as mk
from eaglet.models.llama import rms_norm
from eaglet.models.mla import rotate

from .conftest import hf_model
from .triton_kernels import CACHE_ATTENTION, kernel_matches_general_path, tree_mask, triton_device

DEV = triton_device()


def rope(b, t, r, gen):
    """cos, sin (B, T, 1, R) in the rotate-half layout, at random positions."""
    pos = torch.randint(0, 500, (b, t, 1, 1), generator=gen).float()
    ang = pos * torch.cat([torch.rand(r // 2, generator=gen)] * 2)
    return ang.cos(), ang.sin()


def reference(q_lat, q_pe, kv, w, cache, start, mask, pending, cos, sin, interleaved, scale):
    """The general path in float32: the entries normed and rotated, stored at start.., then each
    query row's softmax over the slots it sees of (latent . q_lat + rotated key . rotated q_pe),
    weighting the latents."""
    b, t, nh, c = q_lat.shape
    f = lambda x: x.float().cpu()  # noqa: E731
    lat = rms_norm(f(kv[..., :c]), f(w), 1e-6).half().float()
    k_pe = rotate(f(kv[..., c:])[:, :, None], f(cos), f(sin), interleaved)[:, :, 0].half().float()
    qp = rotate(f(q_pe), f(cos), f(sin), interleaved).half().float()
    cache = f(cache).clone()
    out = torch.empty(b, t, nh, c)
    for i, s in enumerate(start.tolist()):
        cache[i, s:s + t] = torch.cat([lat[i], k_pe[i]], -1)
        block = mask[i].cpu() if mask is not None else torch.ones(t, t, dtype=torch.bool).tril()
        seen = torch.cat([torch.ones(t, s - pending, dtype=torch.bool), block], 1)  # (T, s + T)
        keys = cache[i, :s + t]  # (s + T, C + R)
        scores = (torch.einsum("thc,sc->hts", f(q_lat[i]), keys[:, :c])
                  + torch.einsum("thr,sr->hts", qp[i], keys[:, c:])) * scale
        p = scores.masked_fill(~seen, float("-inf")).softmax(-1)
        out[i] = torch.einsum("hts,sc->thc", p, keys[:, :c])
    return out, cache


# (rows, heads, kv_lora_rank, rope dim, new tokens, pending, kv_len, tree, interleaved, slots per split or None)
CASES = [(2, 4, 32, 8, 1, 0, 200, False, True, None), (3, 16, 64, 16, 1, 0, 300, False, False, 64),
         (2, 4, 32, 8, 6, 0, 256, True, True, None), (2, 8, 32, 16, 5, 4, 300, True, True, 64),
         (1, 3, 64, 8, 9, 0, 160, False, False, 64), (2, 16, 32, 8, 2, 0, 90, False, True, None),
         # DeepSeek-V2-Lite's widths (512 + 64, 16 heads): a decode over 600 slots at the split rule, a tree level
         (1, 16, 512, 64, 1, 0, 600, False, True, None), (2, 16, 512, 64, 6, 5, 300, True, True, None)]


@pytest.mark.parametrize("b,nh,c,r,t,pending,kv_len,tree,interleaved,chunk", CASES)
def test_matches_the_absorbed_form_and_stores(b, nh, c, r, t, pending, kv_len, tree, interleaved, chunk):
    gen = torch.Generator().manual_seed(0)
    dt = torch.float16
    q_lat = torch.randn(b, t, nh, c, generator=gen).to(DEV, dt) / 4
    q = torch.randn(b, t, nh, 11 + r, generator=gen).to(DEV, dt)  # q_pe is a strided slice of q, as in the model
    q_pe = q[..., 11:]
    kv = torch.randn(b, t, c + r, generator=gen).to(DEV, dt)
    w = (1 + 0.1 * torch.randn(c, generator=gen)).to(DEV, dt)
    cache = torch.randn(b, kv_len + 29, c + r, generator=gen).to(DEV, dt)  # rows longer than the span
    start = torch.randint(pending, kv_len - t + 1, (b,), generator=gen)
    start[0] = kv_len - t  # the last slot of the span
    if b > 1:
        start[1] = pending  # nothing cached before the block
    start = start.to(DEV)
    mask = None
    if tree:
        levels = tree_mask(b, pending + t, gen)[:, pending:]  # the block's nodes see their ancestors among all
        mask = levels.to(DEV)
    cos, sin = (x.to(DEV, dt) for x in rope(b, t, r, gen))
    want, want_cache = reference(q_lat, q_pe, kv, w, cache, start, mask, pending, cos, sin, interleaved, 0.3)
    got = mk.mla_attention(q_lat, q_pe, kv, (w, 1e-6), cache, start, mask, kv_len, pending, (cos, sin), interleaved,
                           0.3, chunk=chunk)
    assert got.shape == (b, t, nh, c)
    torch.testing.assert_close(got.float().cpu(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(cache.float().cpu(), want_cache, atol=2e-3, rtol=2e-3)  # the new entries, nothing else


@pytest.fixture(scope="module")
def mla_dir(tmp_path_factory):
    """A tiny DeepSeek-V3 (MLA with low-rank queries, MoE) whose latent is a power of two wide."""
    d = tmp_path_factory.mktemp("mla")
    hf_model("deepseek_v3", kv_lora_rank=32, num_hidden_layers=2).save_pretrained(d, safe_serialization=True)
    return d


@torch.inference_mode()
def test_model_decoding_matches_the_general_path(mla_dir):
    """A 9-token block, 12 one-token steps, then a 5-node tree block (not committed), with the kernel
    and without: the same logits and the same latent cache."""
    kernel_matches_general_path(mla_dir, mk, "mla_attention")


@pytest.mark.slow
@torch.inference_mode()
@pytest.mark.parametrize("shape", [dict(steps=4), dict(steps=3, topk=2, draft_tokens=6)], ids=["chain4", "tree3x2"])
def test_speculation_through_it_equals_plain_greedy(mla_dir, shape):
    """The MLA target drafting for itself (a draft model): its draft steps, tree levels with earlier
    levels pending, and the verify of each step go through the kernel, and greedy speculation emits
    exactly the plain greedy tokens."""
    from eaglet import GenerationConfig, Generator, load_model
    from eaglet.config import SpecConfig
    from eaglet.spec.speculator import Speculator

    kernels = CACHE_ATTENTION if DEV == "cpu" else Kernels(cache_attention=True, moe=True)  # on a GPU, graphed
    model = load_model(mla_dir, dtype="float16", device=DEV, tokenizer=False, kernels=kernels).model
    prompts = [[5, 17, 33, 40, 9], [11, 60, 3, 21, 8, 90, 4]]
    gen = GenerationConfig(max_new_tokens=14, ignore_eos=True)
    plain = [c.tokens for c in Generator(model, None).generate(prompts, gen)]
    calls = []  # (new tokens per row, pending) of each call
    inner = mk.mla_attention
    mk.mla_attention = lambda *a, **k: calls.append((a[0].shape[1], a[8])) or inner(*a, **k)
    try:
        spec = Generator(model, None, Speculator(SpecConfig("draft", **shape), draft_model=model)).generate(prompts, gen)
    finally:
        mk.mla_attention = inner
    assert [c.tokens for c in spec] == plain
    assert all(c.spec.drafts > 0 for c in spec)
    verify = shape.get("draft_tokens", shape["steps"] + 1)
    assert (verify, 0) in calls  # the target's verify of a whole step
    if "topk" in shape:
        assert any(p > 0 for _, p in calls)  # a tree level over the pending ones before it
