"""eaglet's model against transformers' implementation on tiny random configs of each family member:
prefill, 20 single-token decode steps, and a 5-token extend step on a filled cache (verify's shape)."""
import pytest
import torch

from eaglet.kvcache import KVCache
from eaglet.models.attention import AttnMeta
from eaglet.weights import load_model

from .conftest import FAMILIES

TOL = 1e-4


def eaglet_step(model, cache, ids):
    pos = cache.lens[:, None] + torch.arange(ids.shape[1])
    meta = AttnMeta.build(cache.lens, pos, int(cache.lens.max()) + ids.shape[1],
                          sliding_window=model.config.sliding_window)
    hidden, _ = model(ids, pos, cache, meta)
    cache.advance(ids.shape[1])
    return model.logits(hidden)


@pytest.mark.parametrize("family", list(FAMILIES))
@torch.inference_mode()
def test_logits_match_transformers(family, tiny_dirs):
    path, ref = tiny_dirs[family]
    model = load_model(path, dtype="float32", device="cpu", tokenizer=False).model
    cache = KVCache.for_model(model.config, 1, 64, torch.float32, "cpu")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (1, 12), generator=g)

    out = ref(ids, use_cache=True)
    past = out.past_key_values
    ours = eaglet_step(model, cache, ids)
    assert (ours - out.logits).abs().max() <= TOL, "prefill"

    tok = out.logits[:, -1].argmax(-1, keepdim=True)
    for step in range(20):
        out = ref(tok, past_key_values=past, use_cache=True)
        past = out.past_key_values
        ours = eaglet_step(model, cache, tok)
        assert (ours - out.logits).abs().max() <= TOL, f"decode step {step}"
        tok = out.logits[:, -1].argmax(-1, keepdim=True)

    ext = torch.randint(0, 128, (1, 5), generator=g)  # the shape of a 5-token verify
    out = ref(ext, past_key_values=past, use_cache=True)
    ours = eaglet_step(model, cache, ext)
    assert (ours - out.logits).abs().max() <= TOL, "extend"
    assert int(cache.lens) == 12 + 20 + 5


@pytest.mark.parametrize("family", ["llama3", "qwen3", "mistral", "qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3"])
@torch.inference_mode()
def test_ragged_batch_matches_single(family, tiny_dirs):
    """A right-padded batch of prompts of different lengths gives each prompt's own logits."""
    path, ref = tiny_dirs[family]
    model = load_model(path, dtype="float32", device="cpu", tokenizer=False).model
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 128, (n,), generator=g) for n in (3, 11, 7)]
    cache = KVCache.for_model(model.config, 3, 64, torch.float32, "cpu")
    t = max(len(p) for p in prompts)
    ids = torch.stack([torch.cat([p, torch.zeros(t - len(p), dtype=torch.long)]) for p in prompts])
    pos = torch.arange(t).expand(3, t)
    meta = AttnMeta.build(cache.lens, pos, t, sliding_window=model.config.sliding_window)
    hidden, _ = model(ids, pos, cache, meta)
    cache.advance(torch.tensor([len(p) for p in prompts]))
    nxt = torch.randint(0, 128, (3, 2), generator=g)  # two more tokens each, from ragged lengths
    pos2 = cache.lens[:, None] + torch.arange(2)
    meta2 = AttnMeta.build(cache.lens, pos2, t + 2, sliding_window=model.config.sliding_window)
    hidden2, _ = model(nxt, pos2, cache, meta2)
    for b, p in enumerate(prompts):
        full = torch.cat([p, nxt[b]])[None]
        want = ref(full).logits[0]
        got = torch.cat([model.logits(hidden[b, : len(p)]), model.logits(hidden2[b])])
        assert (got - want).abs().max() <= TOL, f"row {b}"


@torch.inference_mode()
def test_taps_are_residual_stream_entering_layers(tiny_dirs):
    """capture=(i, ...) returns HF's hidden_states[i] (the residual stream entering layer i)."""
    path, ref = tiny_dirs["llama3"]
    model = load_model(path, dtype="float32", device="cpu", tokenizer=False).model
    ids = torch.randint(0, 128, (1, 9))
    cache = KVCache.for_model(model.config, 1, 16, torch.float32, "cpu")
    pos = torch.arange(9)[None]
    _, aux = model(ids, pos, cache, AttnMeta.build(cache.lens, pos, 9), capture=(0, 2, 3))
    hs = ref(ids, output_hidden_states=True).hidden_states
    want = torch.cat([hs[0], hs[2], hs[3]], -1)
    assert aux.shape == (1, 9, 3 * 64)
    assert (aux - want).abs().max() <= TOL


def test_embed_equals_f_embedding():
    """models.llama.embed (indexing for 2-63 ids, F.embedding otherwise) gives F.embedding's rows."""
    import torch.nn.functional as F

    from eaglet.models.llama import embed

    w = torch.randn(50, 8)
    for shape in [(1, 1), (4,), (1, 4), (4, 4), (1, 63), (1, 64), (3, 40)]:
        ids = torch.randint(0, 50, shape)
        assert torch.equal(embed(w, ids), F.embedding(ids, w))
