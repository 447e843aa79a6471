"""The functions a model's kernels compile on the GPU (`@fusable`, eaglet/kernels.py) trace whole
(fullgraph, dynamic shapes) and compute what they compute as written: checked here with the CPU
backend. A configuration runs them compiled exactly when it compiles."""
import pytest
import torch

from eaglet.models.attention import additive_bias, attention_mask
from eaglet.spec.loop import settle
from eaglet.spec.verify import greedy_accept


def test_kernels_fuse_only_where_they_compile():
    from eaglet.kernels import EAGER, Kernels, compiled as shared

    assert EAGER.fuse(attention_mask) is attention_mask
    assert Kernels(compile=True).fuse(attention_mask) is shared(attention_mask)  # one compile, shared
    assert Kernels.choose("cpu") == EAGER and Kernels.choose("cpu", disable=("gemv",)) == EAGER
    with pytest.raises(ValueError, match="unknown kernel 'gemm'"):
        Kernels.choose("cpu", disable=("gemm",))


def compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, dynamic=True, fullgraph=True)


def test_attention_mask_compiled_equals_eager():
    g = torch.Generator().manual_seed(0)
    fn = compiled(attention_mask)
    for bsz, t, pending, kv_len, window in [(2, 1, 0, 16, None), (3, 4, 2, 24, None), (2, 5, 0, 32, 6)]:
        lens = torch.randint(0, kv_len - pending - t, (bsz,), generator=g)
        positions = lens[:, None] + pending + torch.arange(t)
        trees = [None] if window else [None, torch.rand(bsz, t, pending + t, generator=g) < 0.5]
        for tree in trees:
            want = attention_mask(lens, positions, kv_len, tree, pending, window)
            got = fn(lens, positions, kv_len, tree, pending, window)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
    mask = torch.rand(2, 1, 3, 16, generator=g) < 0.5
    for groups in (1, 3):
        assert torch.equal(compiled(additive_bias)(mask, groups, torch.float32),
                           additive_bias(mask, groups, torch.float32))


@pytest.mark.parametrize("n,depth", [(6, 5), (8, 3)])
def test_greedy_accept_compiled_equals_eager(n, depth):
    g = torch.Generator().manual_seed(n)
    fn = compiled(greedy_accept)
    for _ in range(3):
        bsz, vocab = 4, 5  # a small vocabulary: drafts often match the target
        tokens = torch.randint(0, vocab, (bsz, n), generator=g)
        parents = torch.cat([torch.full((bsz, 1), -1), torch.stack([torch.randint(0, i, (bsz,), generator=g)
                                                                    for i in range(1, n)], 1)], 1)
        valid = torch.rand(bsz, n, generator=g) < 0.9
        valid[:, 0] = True
        target = torch.randint(0, vocab, (bsz, n), generator=g)
        for b in range(bsz):  # the target agrees with most drafted children
            for i in range(1, n):
                if torch.rand(1, generator=g) < 0.7:
                    target[b, parents[b, i]] = tokens[b, i]
        want = greedy_accept(tokens, parents, valid, target, depth)
        got = fn(tokens, parents, valid, target, depth)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert want[1].max() > 1  # some row accepted a draft


def test_settle_compiled_equals_eager_in_place_updates_included():
    """The bookkeeping after acceptance, compiled: the same returns, and the same updates of each
    row's limit, cache length and root, made through views of larger buffers (a decoder over its
    first rows slices its state). Row 0 stops at EOS and emits one mid-step: cut there, limit 0;
    row 1 emits an EOS but does not stop at it."""
    g = torch.Generator().manual_seed(1)
    fn = compiled(settle)
    bsz, n, d1 = 3, 7, 4
    path = torch.sort(torch.randint(0, n, (bsz, d1), generator=g), 1).values
    path[:, 0] = 0
    count = torch.tensor([4, 2, 3])
    tokens = torch.randint(0, 50, (bsz, d1), generator=g)
    tokens[0], tokens[1] = torch.tensor([5, 7, 8, 9]), torch.tensor([7, 3, 4, 6])
    eos, stops = torch.tensor([7, 99]), torch.tensor([True, False, True])
    valid = torch.rand(bsz, n, generator=g) < 0.8
    valid[:, 0] = True
    depth = torch.randint(0, d1, (bsz, n), generator=g)
    state = {}
    for name, f in (("eager", settle), ("compiled", fn)):
        limit, lens, roots = torch.tensor([9, 1, 0, 5]), torch.tensor([10, 20, 30, 40]), torch.zeros(4, dtype=torch.long)
        out = f(path, count, tokens, limit[:bsz], lens[:bsz], roots[:bsz], valid, depth, eos, stops)
        state[name] = (out, limit, lens, roots)
    (want, *want_state), (got, *got_state) = state["eager"], state["compiled"]
    flat = lambda o: [t for x in o for t in (x if isinstance(x, tuple) else (x,))]  # noqa: E731
    assert all(torch.equal(a, b) for a, b in zip(flat(got), flat(want)))
    assert all(torch.equal(a, b) for a, b in zip(got_state, want_state))
    limit, lens, roots = want_state
    assert limit.tolist() == [0, 0, 0, 5] and lens.tolist() == [12, 21, 30, 40]  # row 2 frozen: limit 0
    assert roots[:3].tolist() == [7, tokens[1, 0], tokens[2, 0]] and roots[3] == 0


def test_plain_advance_compiled_equals_eager_in_place_updates_included():
    """A plain step's bookkeeping (runtime.plain.advance), compiled, through views of larger buffers:
    row 0 draws the EOS it stops at (limit to 0), row 1 the EOS it does not stop at, row 2 is frozen
    (limit 0: its last token and length stay), row 3 takes its token."""
    from eaglet.runtime.plain import advance

    tok, eos, stops = torch.tensor([7, 7, 5, 6]), torch.tensor([7, 99]), torch.tensor([True, False, True, True])
    state = {}
    for name, f in (("eager", advance), ("compiled", compiled(advance))):
        last, lens, limit = torch.tensor([1, 2, 3, 4, 0]), torch.tensor([10, 20, 30, 40, 0]), torch.tensor([9, 3, 0, 2, 0])
        out = f(tok, last[:4], lens[:4], limit[:4], eos, stops)
        state[name] = (out, last, lens, limit)
    assert all(torch.equal(a, b) for a, b in zip(state["compiled"], state["eager"]))
    out, last, lens, limit = state["eager"]
    assert out.tolist() == [[7, 1], [7, 1], [3, 0], [6, 1]]
    assert last.tolist() == [7, 7, 3, 6, 0] and lens.tolist() == [11, 21, 30, 41, 0]
    assert limit.tolist() == [0, 2, 0, 1, 0]


def test_rope_module_compiled_equals_eager():
    """RoPE as compile_elementwise compiles it on the GPU (dynamic shapes, one graph): at one token its
    q and kv are views of one buffer; at several, the grouped relayout. Both as written."""
    from eaglet.models.llama import RoPE

    g = torch.Generator().manual_seed(0)
    torch._dynamo.reset()
    rope = RoPE(groups=3)
    fn = torch.compile(rope.forward, dynamic=True, fullgraph=True)
    for bsz, t in [(1, 1), (3, 1), (2, 5), (1, 7)]:
        q, k, v = (torch.randn(bsz, t, n, 8, generator=g) for n in (6, 2, 2))
        cos, sin = (torch.randn(bsz, t, 1, 8, generator=g) for _ in range(2))
        want, got = rope(q, k, v, cos, sin), fn(q, k, v, cos, sin)
        assert [w.shape for w in want] == [(bsz, 2, 3 * t, 8), (bsz, t, 2, 2, 8)]
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, want))


@pytest.mark.parametrize("factors", [False, True])
def test_rope_cos_sin_compiled_equals_eager(factors):
    """RoPE's cos and sin, as compiled on the GPU (one kernel per forward), with and without
    llama.cpp's frequency divisors."""
    from eaglet.models.llama import rope_cos_sin

    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    div = torch.linspace(1, 4, 8) if factors else None
    fn = compiled(rope_cos_sin)
    for b, t in ((1, 1), (3, 7)):
        pos = torch.randint(0, 500, (b, t))
        for got, want in zip(fn(pos, inv_freq, torch.float32, div), rope_cos_sin(pos, inv_freq, torch.float32, div)):
            assert got.shape == (b, t, 1, 16)
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_ancestor_mask_compiled_equals_eager():
    """The tree proposals' ancestor mask as compiled on the GPU: random trees (parents before
    children), with and without a depth bound, at two sizes under one dynamic compile."""
    from eaglet.spec.tree import ancestor_mask

    g = torch.Generator().manual_seed(0)
    fn = compiled(ancestor_mask)
    for bsz, n, max_depth in [(2, 8, None), (3, 12, 6), (1, 5, 4)]:
        parents = torch.cat([torch.full((bsz, 1), -1), torch.stack([torch.randint(0, i, (bsz,), generator=g)
                                                                    for i in range(1, n)], 1)], 1)
        want = ancestor_mask(parents, max_depth)
        got = fn(parents, max_depth)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert want[1].max() > 1  # some node deeper than the root's children


def test_tree_level_bookkeeping_compiled_equals_eager():
    """What a draft tree does between levels, as compiled on the GPU: the level's mask and the
    block's ancestry (level_mask), the next frontier (next_frontier, with and without states), the
    candidates of every level (candidates), and the kept tree (tree.kept_tree), over the levels of
    a 4-level tree of 3 and of 2 rows."""
    from eaglet.spec.drafters.expand import candidates, level_mask, next_frontier
    from eaglet.spec.tree import kept_tree

    g = torch.Generator().manual_seed(0)
    fns = {f: compiled(f) for f in (level_mask, next_frontier)}
    for b, k in [(2, 3), (1, 2)]:
        anc = torch.eye(k, dtype=torch.bool).expand(b, k, k)
        par_fed, toks, scores, fronts = None, [], [], []
        front = torch.arange(k).expand(b, k)
        for d in range(1, 5):
            p = (d - 1) * k
            if d > 1:
                want = level_mask(anc, par_fed)
                got = fns[level_mask](anc, par_fed)
                assert all(torch.equal(x, y) for x, y in zip(got, want))
                assert want[0].shape == (b, k, p + k) and want[1].shape == (b, p + k, p + k)
                anc = want[1]
            child_ids = torch.randint(0, 50, (b, k, k), generator=g)
            best = torch.stack([torch.randperm(k * k, generator=g)[:k] for _ in range(b)])
            for state in (None, torch.randn(b, k, 4, generator=g)):
                args = (best, child_ids, state, k + (d - 1) * k * k, p)
                want, got = next_frontier(*args), fns[next_frontier](*args)
                assert all(x is None and y is None or torch.equal(x, y) for x, y in zip(got, want))
            toks.append(child_ids.flatten(1))
            scores.append(-torch.rand(b, k * k, generator=g) * d)
            fronts.append(front)
            _, front, par_fed, _ = want
    c_tok = [torch.randint(0, 50, (b, k), generator=g)] + toks
    c_score = [-torch.rand(b, k, generator=g)] + scores
    want = candidates(c_tok, c_score, fronts)
    got = compiled(candidates)(c_tok, c_score, fronts)
    assert all(torch.equal(x, y) for x, y in zip(got, want))
    assert want[0].shape == want[1].shape == want[2].shape == (b, k + 4 * k * k)
    assert want[1][:, :k].eq(-1).all() and want[1][:, k:].ge(0).all()  # the first level's parent: the root
    best = want[2].topk(6, -1).indices
    roots = torch.randint(0, 50, (b,), generator=g)
    args = (best, roots, want[0], want[1], want[2], 5)
    assert all(torch.equal(x, y) for x, y in zip(compiled(kept_tree)(*args), kept_tree(*args)))


def test_eagle3_midlayer_input_compiled_equals_eager_and_the_norms():
    from eaglet.models.llama import RMSNorm
    from eaglet.spec.drafters.eagle3_head import midlayer_input

    g = torch.Generator().manual_seed(2)
    emb, h = torch.randn(2, 3, 8, generator=g), torch.randn(2, 3, 8, generator=g)
    a, b = RMSNorm(8, 1e-5), RMSNorm(8, 1e-6)
    with torch.no_grad():
        a.weight.uniform_(0.5, 1.5, generator=g)
        b.weight.uniform_(0.5, 1.5, generator=g)
    want = midlayer_input(emb, h, a.weight, b.weight, a.eps, b.eps)
    got = compiled(midlayer_input)(emb, h, a.weight, b.weight, a.eps, b.eps)
    assert torch.equal(want[0], torch.cat([a(emb), b(h)], -1)) and torch.equal(want[1], b(h))
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


def test_ngram_lookup_and_trie_compiled_equal_eager():
    """The n-gram drafter's device lookup and trie (spec/drafters/ngram.py), traced whole."""
    from eaglet.spec.drafters.ngram import continuations, trie

    g = torch.Generator().manual_seed(0)
    look, merge = compiled(continuations), compiled(trie)
    for ngram_min, ngram_max, steps, want in [(1, 4, 5, 1), (2, 3, 3, 4)]:
        hist = torch.randint(0, 4, (3, 40), generator=g)
        lens = torch.tensor([40, 17, 2])
        got = look(hist, lens, ngram_min, ngram_max, steps, want)
        want_ = continuations(hist, lens, ngram_min, ngram_max, steps, want)
        assert all(torch.equal(a, b) for a, b in zip(got, want_))
        got = merge(*want_, steps + want)
        assert all(torch.equal(a, b) for a, b in zip(got, trie(*want_, steps + want)))


def test_gumbel_argmax_compiled_equals_eager():
    """A sampled row's draw (sampling.gumbel_argmax: hash, Gumbel noise and argmax over the
    vocabulary), compiled as on the GPU: the same tokens, for a (B,) and a (B, N) set of positions."""
    from eaglet.sampling import RowSampling, SamplingParams, gumbel_argmax

    rs = RowSampling(3, "cpu")
    rs.set([0, 1, 2], [SamplingParams(1.0)] * 3, [5, 6, 7])
    rs.base[:] = torch.tensor([4, 9, 2])
    x = torch.randn(3, 4, 300, generator=torch.Generator().manual_seed(3))
    ids = rs.vocab_ids(300)
    for seed, logits in ((rs.seeds(1), x[:, 0]), (rs.seeds(torch.arange(4).expand(3, 4)), x)):
        assert torch.equal(compiled(gumbel_argmax)(logits, seed, ids), gumbel_argmax(logits, seed, ids))


def test_position_seeds_compiled_equal_eager():
    """Each row's noise key at its positions (sampling.position_seeds), compiled as the GPU's steps
    run it: the same keys for int offsets (0 and 1, which the compiler specializes, and others) and
    (B, N) ones, 62-bit stream keys included."""
    from eaglet.sampling import RowSampling, SamplingParams, position_seeds

    rs = RowSampling(3, "cpu")
    rs.set([0, 1, 2], [SamplingParams(1.0)] * 3, [5, (1 << 62) - 3, 123456789012345])
    rs.base[:] = torch.tensor([4, 9, 2])
    fn = compiled(position_seeds)
    for offset in (0, 1, 6, torch.arange(4).expand(3, 4), torch.arange(12).view(3, 4) % 5):
        want = position_seeds(rs.key, rs.base, offset)
        assert torch.equal(fn(rs.key, rs.base, offset), want)
        assert torch.equal(rs.seeds(offset), want)
    assert len(set(fn(rs.key, rs.base, 6).tolist())) == 3  # rows keyed apart


def test_mla_rope_entry_and_latent_softmax_compiled_equal_eager():
    """MLA's fusable parts: the rotation of q's rotary part with the cache entry (interleaved pairs or
    not), and the attention weights from the latent and rotary scores with the mask."""
    from eaglet.models.mla import latent_softmax, rope_entry

    g = torch.Generator().manual_seed(0)
    for b, t, nh in ((1, 1, 4), (2, 5, 3)):
        q_pe, k_pe = torch.randn(b, t, nh, 8, generator=g), torch.randn(b, t, 8, generator=g)
        c, cos, sin = torch.randn(b, t, 16, generator=g), torch.randn(b, t, 1, 8, generator=g), torch.randn(b, t, 1, 8, generator=g)
        for interleaved in (True, False):
            want = rope_entry(q_pe, k_pe, c, cos, sin, interleaved)
            got = compiled(rope_entry)(q_pe, k_pe, c, cos, sin, interleaved)
            assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(got, want))
        nope, pe = torch.randn(b, nh, t, 12, generator=g), torch.randn(b, nh, t, 12, generator=g)
        mask = torch.where(torch.rand(b, 1, t, 12, generator=g) < 0.3, float("-inf"), 0.0)
        mask[..., 0] = 0.0
        assert torch.allclose(compiled(latent_softmax)(nope, pe, mask, 0.3), latent_softmax(nope, pe, mask, 0.3),
                              atol=1e-6)
