"""The one-token attention kernel (models/decode_attention.py), on the CPU through Triton's
interpreter (conftest sets TRITON_INTERPRET=1 without a GPU), in float16 (the interpreter has no
bfloat16): it stores the new key and value where the indexed store would and attends like SDPA,
in one split and in several; a model decoding with it matches the SDPA path; EAGLE-3 chain
drafting runs through it and greedy speculation stays lossless."""
import os

import pytest
import torch

from eaglet import GenerationConfig, Generator, load_model
from eaglet.config import SpecConfig
from eaglet.kvcache import KVCache
from eaglet.models import decode_attention as da
from eaglet.models.attention import AttnMeta
from eaglet.spec.speculator import Speculator

from .test_spec_greedy import random_head

pytest.importorskip("triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1 (set by conftest)", allow_module_level=True)


@pytest.fixture
def kernel_on():
    da.enable()
    yield
    da.enable(False)


def reference(q, kv, k_cache, v_cache, slots):
    """The general path: indexed store, then attention over slots 0..slot in float32."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    out = []
    for b, s in enumerate(slots.tolist()):
        k_cache[b, :, s], v_cache[b, :, s] = kv[b, 0, 0], kv[b, 0, 1]
        o = torch.nn.functional.scaled_dot_product_attention(q[b].float(), k_cache[b, :, :s + 1].float(),
                                                             v_cache[b, :, :s + 1].float())
        out.append(o.reshape(-1))
    return torch.stack(out), k_cache, v_cache


# (rows, kv heads, query heads per kv head, head dim, kv_len, slots per split or None for the default)
CASES = [(2, 3, 3, 64, 256, None), (3, 2, 4, 128, 700, None), (2, 3, 3, 64, 256, 64), (3, 1, 1, 64, 200, 64),
         (1, 8, 4, 128, 2048, None)]


@pytest.mark.parametrize("b,hkv,g,d,kv_len,chunk", CASES)
def test_matches_sdpa_and_stores(b, hkv, g, d, kv_len, chunk):
    torch.manual_seed(0)
    dt = torch.float16
    q = torch.randn(b, hkv, g, d, dtype=dt, device=DEV)
    kv = torch.randn(b, 1, 2, hkv, d, dtype=dt, device=DEV)
    cache = torch.randn(2, b, hkv, kv_len + 37, d, dtype=dt, device=DEV)  # rows longer than the span
    slots = torch.randint(0, kv_len, (b,), device=DEV)
    slots[0] = kv_len - 1  # the last split's last slot
    if b > 1:
        slots[1] = 0  # nothing cached: only the new token
    if b > 2:
        slots[2] = 64  # the first slot of a split (with 64 slots per split)
    want, k_want, v_want = reference(q, kv, cache[0], cache[1], slots)
    got = da.decode_attention(q, kv, cache[0], cache[1], slots[:, None], kv_len, chunk)
    if chunk:
        assert -(-kv_len // chunk) > 1  # the combine kernel ran
    assert got.shape == (b, hkv * g * d) and got.dtype == dt
    torch.testing.assert_close(got.float(), want, atol=3e-3, rtol=3e-3)
    assert torch.equal(cache[0], k_want) and torch.equal(cache[1], v_want)


def test_split_size_covers_the_span():
    for n in (1, 100, 512, 513, 2048, 4096, 32768):
        c = da.split_size(n)
        assert c >= 64 and -(-n // c) <= 16


@pytest.fixture(scope="module")
def half_model(tiny_dirs):
    """The tiny SmolLM2-shaped model (4 query heads on 1 kv head) in float16."""
    return load_model(tiny_dirs["smollm2"][0], dtype="float16", device=DEV, tokenizer=False).model


@torch.inference_mode()
def test_model_decoding_matches_sdpa(half_model, kernel_on):
    """Prefill (SDPA) then 12 one-token steps, with the kernel and without: same logits, same cache."""
    model = half_model
    c = model.config
    torch.manual_seed(1)
    prompt = torch.randint(3, c.vocab_size, (2, 9), device=DEV)
    runs = []
    for on in (True, False):
        da.enable(on)
        calls = []
        inner = da.decode_attention
        da.decode_attention = lambda *a, **k: calls.append(1) or inner(*a, **k)
        try:
            cache = KVCache.for_model(c, 2, 64, torch.float16, DEV)
            ids, logits = prompt, []
            for _ in range(13):
                t = ids.shape[1]
                pos = cache.lens[:, None] + torch.arange(t, device=DEV)
                meta = AttnMeta.build(cache.lens, pos, cache.kv_len(t))
                h, _ = model(ids, pos, cache, meta)
                cache.advance(t)
                lg = model.logits(h[:, -1]).float()
                logits.append(lg)
                ids = lg.argmax(-1, keepdim=True)
        finally:
            da.decode_attention = inner
        assert len(calls) == (12 * c.num_layers if on else 0)
        runs.append((torch.stack(logits), cache.kv[..., :cache.host_lens.max(), :].clone()))
    (la, ca), (lb, cb) = runs
    torch.testing.assert_close(la, lb, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(ca, cb, atol=2e-2, rtol=2e-2)


@torch.inference_mode()
def test_chain_drafting_uses_it_and_stays_lossless(half_model, kernel_on, tiny_tokenizer):
    """Plain decoding and every EAGLE-3 chain draft step go through the kernel; greedy speculation
    emits exactly the plain greedy tokens."""
    from eaglet.tokenizer import Tokenizer

    model = half_model
    tok = Tokenizer(tiny_tokenizer, {2})
    head = random_head(model.config).to(device=DEV, dtype=torch.float16)
    sp = Speculator(SpecConfig("eagle3", steps=4), head=head)
    prompts = [tiny_tokenizer.encode(p) for p in ("the quick brown fox", "pack my box with five")]
    gen = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    calls = []
    inner = da.decode_attention
    da.decode_attention = lambda *a, **k: calls.append(a[2].shape[2] == head.cfg.layer.num_kv_heads) or inner(*a, **k)
    try:
        plain = [c.tokens for c in Generator(model, tok).generate(prompts, gen)]
        n_plain = len(calls)
        spec = Generator(model, tok, sp).generate(prompts, gen)
    finally:
        da.decode_attention = inner
    assert n_plain == 23 * model.config.num_layers  # every decode step after the prefill's first token
    assert len(calls) > n_plain  # the chain's draft steps (3 per speculation step) too
    assert [c.tokens for c in spec] == plain
    assert all(c.spec.drafts > 0 for c in spec)
