"""The cache attention kernel (models/cache_attention.py), on the CPU through Triton's interpreter
(conftest sets TRITON_INTERPRET=1 without a GPU), in float16 (the interpreter has no bfloat16): it
stores the new keys and values where the indexed store would and attends like SDPA over the cached
prefix and the new tokens (causal or a tree mask), in one split and in several, in one tile of query
rows and in several; a model decoding and verifying with it matches the SDPA path; EAGLE-3 chain
drafting runs through it and greedy speculation stays lossless."""
import pytest
import torch

from eaglet import GenerationConfig, Generator, load_model
from eaglet.config import SpecConfig
from eaglet.models import cache_attention as ca
from eaglet.spec.speculator import Speculator

from .conftest import hf_model
from .test_spec_greedy import random_head

from .triton_kernels import CACHE_ATTENTION, kernel_matches_general_path, tree_mask, triton_device

DEV = triton_device()


def reference(qkv, k_cache, v_cache, start, mask, groups, pending=0):
    """The general path: indexed store, then SDPA (float32) of each query over slots before start
    and the new tokens it may see; with `pending`, the mask (T, pending + T) also covers the
    `pending` slots before start."""
    b, t, heads, d = qkv.shape
    hkv = k_cache.shape[1]
    h = heads - 2 * hkv
    q, k, v = qkv[:, :, :h], qkv[:, :, h:h + hkv], qkv[:, :, h + hkv:]
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    out = torch.empty(b, t, h, d)
    for i, s in enumerate(start.tolist()):
        k_cache[i, :, s:s + t], v_cache[i, :, s:s + t] = k[i].transpose(0, 1), v[i].transpose(0, 1)
        block = mask[i] if mask is not None else torch.ones(t, t, dtype=torch.bool).tril()
        seen = torch.cat([torch.ones(t, s - pending, dtype=torch.bool), block.cpu()], 1)  # (T, s + T)
        keys = k_cache[i, :, :s + t].float().repeat_interleave(groups, 0)  # (H, s+T, D)
        vals = v_cache[i, :, :s + t].float().repeat_interleave(groups, 0)
        o = torch.nn.functional.scaled_dot_product_attention(q[i].float().transpose(0, 1), keys, vals,
                                                             attn_mask=seen.to(DEV))  # (H, T, D)
        out[i] = o.transpose(0, 1).cpu()
    return out.reshape(b, t, h * d), k_cache, v_cache


# (rows, kv heads, query heads per kv head, head dim, new tokens, kv_len, tree, slots per split or None,
#  query rows per program or None)
CASES = [(2, 3, 3, 64, 1, 256, False, None, None), (3, 2, 4, 128, 1, 700, False, None, None),
         (3, 3, 3, 64, 1, 256, False, 64, None), (3, 1, 1, 64, 1, 200, False, 64, None),
         (1, 8, 4, 128, 1, 2048, False, None, None), (2, 3, 3, 64, 6, 256, False, None, None),
         (3, 3, 3, 64, 6, 300, True, 64, None), (2, 2, 4, 64, 20, 512, True, None, None),
         (2, 1, 4, 64, 32, 400, False, 128, None), (2, 2, 4, 64, 16, 300, True, 128, 16)]


@pytest.mark.parametrize("b,hkv,g,d,t,kv_len,tree,chunk,rows", CASES)
def test_matches_sdpa_and_stores(b, hkv, g, d, t, kv_len, tree, chunk, rows):
    gen = torch.Generator().manual_seed(0)
    dt = torch.float16
    qkv = torch.randn(b, t, hkv * (g + 2), d, generator=gen).to(DEV, dt)
    cache = torch.randn(2, b, hkv, kv_len + 37, d, generator=gen).to(DEV, dt)  # rows longer than the span
    start = torch.randint(0, kv_len - t + 1, (b,), generator=gen)
    start[0] = kv_len - t  # the last slot of the span
    if b > 1:
        start[1] = 0  # nothing cached: only the new tokens
    if b > 2:
        start[2] = 64  # the first slot of a split of 64
    start = start.to(DEV)
    mask = tree_mask(b, t, gen).to(DEV) if tree else None
    want, k_want, v_want = reference(qkv, cache[0], cache[1], start, mask, g)
    got = ca.cache_attention(qkv, cache[0], cache[1], start[:, None].expand(b, 3)[:, 0], mask, kv_len, g, chunk, rows)
    if chunk:
        assert -(-kv_len // chunk) > 1  # the combine kernel ran
    assert got.shape == (b, t, hkv * g * d) and got.dtype == dt
    torch.testing.assert_close(got.float().cpu(), want, atol=3e-3, rtol=3e-3)
    assert torch.equal(cache[0], k_want) and torch.equal(cache[1], v_want)


def level_mask(b, pending, t, gen):
    """A draft tree's next level: t new nodes, each seeing itself and a random earlier node's
    ancestry among the `pending` entries before them (or only the committed prefix)."""
    full = tree_mask(b, pending, gen)
    m = torch.zeros(b, t, pending + t, dtype=torch.bool)
    for i in range(b):
        for u in range(t):
            m[i, u, pending + u] = True
            parent = int(torch.randint(-1, pending, (1,), generator=gen))
            if parent >= 0:
                m[i, u, :pending] = full[i, parent]
    return m


@pytest.mark.parametrize("b,hkv,g,d,t,pending,kv_len,chunk", [(2, 3, 3, 64, 4, 4, 256, None), (3, 1, 4, 64, 8, 40, 300, 64),
                                                           (2, 2, 2, 128, 1, 17, 200, None), (1, 3, 3, 64, 8, 8, 700, None)])
def test_tree_levels_see_the_pending_entries_their_mask_allows(b, hkv, g, d, t, pending, kv_len, chunk):
    """A draft level after `pending` nodes of earlier levels (already in the cache before start): the
    kernel sees the committed prefix, the pending entries its mask allows and the new tokens as the
    mask allows, in one split and in several."""
    gen = torch.Generator().manual_seed(3)
    dt = torch.float16
    qkv = torch.randn(b, t, hkv * (g + 2), d, generator=gen).to(DEV, dt)
    cache = torch.randn(2, b, hkv, kv_len + 5, d, generator=gen).to(DEV, dt)
    start = torch.randint(pending, kv_len - t + 1, (b,), generator=gen)
    start[0] = pending  # nothing committed: only the pending entries and the new tokens
    if b > 1:
        start[1] = kv_len - t
    start = start.to(DEV)
    mask = level_mask(b, pending, t, gen).to(DEV)
    want, k_want, v_want = reference(qkv, cache[0], cache[1], start, mask, g, pending)
    got = ca.cache_attention(qkv, cache[0], cache[1], start, mask, kv_len, g, chunk, pending=pending)
    torch.testing.assert_close(got.float().cpu(), want, atol=3e-3, rtol=3e-3)
    assert torch.equal(cache[0], k_want) and torch.equal(cache[1], v_want)
    # a level that saw every pending entry would differ: the mask is applied
    every = mask.clone()
    every[..., :pending] = True
    assert not torch.allclose(reference(qkv, cache[0], cache[1], start, every, g, pending)[0], want, atol=3e-3)


@pytest.mark.parametrize("t,tree,norm", [(1, False, False), (6, True, False), (16, False, True), (5, True, True)])
def test_rotates_and_norms_as_it_loads(t, tree, norm):
    """Given the projection's raw q, k, v with cos/sin (and Qwen3's per-head q/k RMSNorm), the kernel
    attends and stores what the RoPE and RMSNorm modules' output would give it."""
    from eaglet.config import RopeConfig, rope_inv_freq
    from eaglet.models.llama import RMSNorm, rope_cos_sin, rotate_half

    gen = torch.Generator().manual_seed(2)
    b, hkv, g, d, kv_len, dt = 2, 2, 3, 64, 128, torch.float16
    qkv = torch.randn(b, t, hkv * (g + 2), d, generator=gen).to(DEV, dt)
    cache = torch.randn(2, b, hkv, kv_len, d, generator=gen).to(DEV, dt)
    start = torch.tensor([40, 100 - t]).to(DEV)
    positions = start[:, None] + torch.arange(t, device=DEV)
    cos, sin = rope_cos_sin(positions, rope_inv_freq(RopeConfig(theta=10000.0), d).to(DEV), dt)
    h = hkv * g
    q, k, v = qkv[:, :, :h], qkv[:, :, h:h + hkv], qkv[:, :, h + hkv:]
    qk_norm = None
    if norm:
        qn, kn = RMSNorm(d, 1e-6), RMSNorm(d, 1e-6)
        for n in (qn, kn):
            n.weight.data = (0.5 + torch.rand(d, generator=gen)).to(DEV, dt)
        q, k = qn(q), kn(k)
        qk_norm = (qn.weight, kn.weight, 1e-6)
    rq, rk = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    mask = tree_mask(b, t, gen).to(DEV) if tree else None
    want, k_want, v_want = reference(torch.cat([rq, rk, v], 2), cache[0], cache[1], start, mask, g)
    got = ca.cache_attention(qkv, cache[0], cache[1], start, mask, kv_len, g, rope=(cos, sin), qk_norm=qk_norm)
    torch.testing.assert_close(got.float().cpu(), want, atol=4e-3, rtol=4e-3)
    torch.testing.assert_close(cache[0].float(), k_want.float(), atol=2e-3, rtol=2e-3)  # rotated keys stored
    assert torch.equal(cache[1], v_want)
    assert not torch.allclose(cache[0][0, :, 40:40 + t].float(), k[0].transpose(0, 1).float())  # not the raw keys


def test_split_size_covers_the_span():
    for n in (1, 100, 256, 257, 512, 513, 2048, 4096, 32768):
        for programs in (1, 3, 48, 128, 1024):
            c = ca.split_size(n, programs)
            assert c >= 64 and -(-n // c) <= ca.MAX_SPLITS
            assert (c >= n) == (n <= 256 or programs > 128)  # one split only for short spans or a full GPU


def test_row_tiles_cover_every_query_row():
    for g in (1, 3, 4, 8):
        for t in (1, 6, 16, 20, 64, 256):
            for heads in (1, 8, 16, 17, 512):
                rows, tiles = ca.row_tiles(g, t, heads)
                assert rows in (16, 32, 64) and (tiles - 1) * rows < g * t <= tiles * rows
                if heads <= 16 and g * t <= 64:
                    assert rows == 16  # few programs: small tiles (the H200 probe)
                if heads > 16:
                    assert tiles == -(-g * t // 64)  # many programs: the fewest tiles


@pytest.fixture(scope="module")
def half_model(tmp_path_factory):
    """A tiny SmolLM2-shaped model (4 query heads on 1 kv head; 3 layers, the fewest the EAGLE-3
    head's three taps need) in float16, running the kernel."""
    d = tmp_path_factory.mktemp("half")
    hf_model("smollm2", num_hidden_layers=3).save_pretrained(d, safe_serialization=True)
    return load_model(d, dtype="float16", device=DEV, tokenizer=False, kernels=CACHE_ATTENTION).model


@torch.inference_mode()
@pytest.mark.parametrize("arch", ["smollm2", "qwen3"])
def test_model_decoding_matches_sdpa(tiny_dirs, arch):
    """A 9-token block, 12 one-token steps, then a 5-node tree block (not committed), with the
    kernel and without: the same logits and the same cache (Qwen3: its q/k norm in the kernel)."""
    assert load_model(tiny_dirs[arch][0], dtype="float32", tokenizer=False).model.config.qk_norm == (arch == "qwen3")
    kernel_matches_general_path(tiny_dirs[arch][0], ca, "cache_attention")


@pytest.mark.slow
@torch.inference_mode()
def test_chain_drafting_uses_it_and_stays_lossless(half_model, tiny_tokenizer):
    """Plain decoding and every EAGLE-3 chain draft step go through the kernel; greedy speculation
    emits exactly the plain greedy tokens."""
    from eaglet.tokenizer import Tokenizer

    model = half_model
    tok = Tokenizer(tiny_tokenizer, {2})
    head = random_head(model.config, kernels=CACHE_ATTENTION).to(device=DEV, dtype=torch.float16)
    sp = Speculator(SpecConfig("eagle3", steps=4), head=head)
    prompts = [tiny_tokenizer.encode(p) for p in ("the quick brown fox", "pack my box with five")]
    gen = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    calls = []  # new tokens per row of each call
    inner = ca.cache_attention
    ca.cache_attention = lambda *a, **k: calls.append(a[0].shape[1]) or inner(*a, **k)
    try:
        # eager: a graph's replay would not call the kernel's Python function (on the GPU)
        plain = [c.tokens for c in Generator(model, tok, graphs=False).generate(prompts, gen)]
        n_plain = len(calls)
        spec = Generator(model, tok, sp, graphs=False).generate(prompts, gen)
    finally:
        ca.cache_attention = inner
    assert n_plain == 11 * model.config.num_layers and set(calls[:n_plain]) == {1}  # each decode step
    by_size = {t: calls[n_plain:].count(t) for t in set(calls[n_plain:])}
    assert by_size.get(1, 0) > 0  # chain draft steps (the target never runs one token while speculating)
    assert by_size.get(5, 0) >= model.config.num_layers  # verify (a chain of 4 and its root), the drafter catching up
    assert [c.tokens for c in spec] == plain
    assert all(c.spec.drafts > 0 for c in spec)


@pytest.mark.slow
@torch.inference_mode()
def test_tree_drafting_uses_it_and_stays_lossless(half_model, tiny_tokenizer):
    """Every level of an EAGLE-3 draft tree goes through the kernel, the levels after the first with
    the earlier levels pending and a tree mask over them; greedy speculation emits exactly the plain
    greedy tokens."""
    from eaglet.tokenizer import Tokenizer

    model = half_model
    tok = Tokenizer(tiny_tokenizer, {2})
    head = random_head(model.config, kernels=CACHE_ATTENTION).to(device=DEV, dtype=torch.float16)
    sp = Speculator(SpecConfig("eagle3", steps=3, topk=2, draft_tokens=6), head=head)
    prompts = [tiny_tokenizer.encode(p) for p in ("the quick brown fox", "pack my box with five")]
    gen = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    plain = [c.tokens for c in Generator(model, tok, graphs=False).generate(prompts, gen)]
    calls = []  # (new tokens per row, pending) of each call
    inner = ca.cache_attention
    ca.cache_attention = lambda *a, **k: calls.append((a[0].shape[1], k.get("pending", 0))) or inner(*a, **k)
    try:
        spec = Generator(model, tok, sp, graphs=False).generate(prompts, gen)
    finally:
        ca.cache_attention = inner
    assert [c.tokens for c in spec] == plain
    levels = {c for c in calls if c[1] > 0}
    assert levels == {(2, 2)}  # the third level: 2 frontier nodes after the 2 of the second
    assert calls.count((2, 0)) >= calls.count((2, 2))  # the second level: nothing pending yet
    assert all(c.spec.drafts > 0 for c in spec)
