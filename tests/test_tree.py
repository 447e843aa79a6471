"""Draft trees on hand-built examples: ancestor masks and depth, the EAGLE-2 selection of the best
nodes, the attention mask over cache slots, one verify-accept-commit round of the real loop against
recomputation from scratch, the cut to a row's limit, and the n-gram drafter's matching and trie."""
import pytest
import torch

from eaglet.config import SpecConfig
from eaglet.models.attention import AttnMeta
from eaglet.spec.drafters.base import start_rows
from eaglet.spec.drafters.ngram import NgramDrafter, continuations, trie
from eaglet.spec.loop import spec_decoder
from eaglet.spec.tree import DraftProposal, ancestor_mask, chain, select_tree
from eaglet.spec.verify import VerifyResult, cut
from eaglet.weights import load_model

from .test_kvcache import assert_same_prefix, recompute, run

#        0            node: parent
#      /   \          1: 0, 2: 0, 3: 1, 4: 1, 5: 2, 6: 5
#     1     2
#    / \     \
#   3   4     5
#              \
#               6
PARENTS = [-1, 0, 0, 1, 1, 2, 5]
MASK = [[1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],
        [1, 0, 1, 0, 0, 1, 0],
        [1, 0, 1, 0, 0, 1, 1]]
DEPTH = [0, 1, 1, 2, 2, 2, 3]


def as_bool(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.bool)


# ---- ancestor masks -----------------------------------------------------------------------------

def test_ancestor_mask_and_depth_exact():
    parents = torch.tensor([PARENTS, [-1, 0, 1, 2, 3, 4, 5]])  # row 1: a chain
    mask, depth = ancestor_mask(parents)
    assert torch.equal(mask[0], as_bool(MASK))
    assert torch.equal(mask[1], torch.ones(7, 7, dtype=torch.bool).tril())
    assert depth.tolist() == [DEPTH, list(range(7))]
    # a max_depth of the true depth gives the same
    mask3, depth3 = ancestor_mask(parents[:1], max_depth=3)
    assert torch.equal(mask3, mask[:1]) and torch.equal(depth3, depth[:1])


def test_chain_and_from_parents():
    tokens = torch.tensor([[7, 8, 9, 10]])
    prop = chain(tokens)
    assert prop.parents.tolist() == [[-1, 0, 1, 2]] and prop.depth.tolist() == [[0, 1, 2, 3]]
    assert torch.equal(prop.mask[0], torch.ones(4, 4, dtype=torch.bool).tril())
    assert prop.valid.all() and prop.num_nodes == 4
    # the closed form equals what ancestor_mask derives from the same parents, at several lengths
    for n in (1, 2, 6, 9):
        p = chain(torch.zeros(3, n, dtype=torch.long))
        ref = DraftProposal.from_parents(p.tokens, p.parents.clone(), max_depth=n - 1)
        assert torch.equal(p.mask, ref.mask) and torch.equal(p.depth, ref.depth) and p.mask.shape == (3, n, n)
    tree = DraftProposal.from_parents(torch.arange(7)[None], torch.tensor([PARENTS]))
    assert torch.equal(tree.mask[0], as_bool(MASK)) and tree.depth.tolist() == [DEPTH]


# ---- select_tree --------------------------------------------------------------------------------

# candidates, level by level: 0-2 under the root; 3, 4 under 0; 5 under 1; 6 under 2; 7 under 3; 8 under 5
C_TOKENS = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17, 18]] * 2)
C_PARENTS = torch.tensor([[-1, -1, -1, 0, 0, 1, 2, 3, 5]] * 2)
C_SCORES = torch.tensor([[-0.1, -1.0, -2.0, -0.3, -1.5, -1.2, -2.5, -0.35, -1.3],
                         [-3.0, -0.2, -2.9, -3.1, -3.2, -0.4, -3.05, -3.3, -0.5]])


def test_select_tree_keeps_best_and_remaps_parents():
    prop = select_tree(torch.tensor([100, 200]), C_TOKENS, C_PARENTS, C_SCORES, num_nodes=6, max_depth=3)
    # row 0 keeps candidates 0, 1, 3, 5, 7; row 1 keeps 0, 1, 2, 5, 8 (in candidate order)
    assert prop.tokens.tolist() == [[100, 10, 11, 13, 15, 17], [200, 10, 11, 12, 15, 18]]
    assert prop.parents.tolist() == [[-1, 0, 0, 1, 2, 3], [-1, 0, 0, 0, 2, 4]]
    assert prop.depth.tolist() == [[0, 1, 1, 2, 2, 3], [0, 1, 1, 1, 2, 3]]
    assert prop.valid.all()
    assert torch.equal(prop.mask, ancestor_mask(prop.parents)[0])


@pytest.mark.parametrize("mag", [0.5, 20.0, 1000.0])
def test_select_tree_exact_ties_keep_parent_first(mag):
    """A child whose log-probability is 0 ties its parent exactly; cutting the budget between them
    must keep the parent. (At |score| >= 16 a float32 epsilon tie-break rounds away.)"""
    scores = torch.tensor([[-mag, -mag - 5, -mag, -mag]])  # 2 under 0, 3 under 2: all tied but 1
    args = torch.tensor([[1, 2, 3, 4]]), torch.tensor([[-1, -1, 0, 2]]), scores
    for keep, tokens, parents in [(1, [1], [0]), (2, [1, 3], [0, 1]), (3, [1, 3, 4], [0, 1, 2])]:
        prop = select_tree(torch.tensor([0]), *args, num_nodes=keep + 1, max_depth=3)
        assert prop.tokens[0, 1:].tolist() == tokens and prop.parents[0, 1:].tolist() == parents


def test_select_tree_random_ties_never_orphan():
    """Random level-by-level candidates (like expand.py) at large |score|, many exact ties."""
    g = torch.Generator().manual_seed(0)
    b, k, levels = 64, 3, 4
    par = [-1] * k
    front = list(range(k))
    for _ in range(2, levels + 1):  # each frontier node gets k children; the first k form the next frontier
        new = [len(par) + i for i in range(k * k)]
        par += [p for p in front for _ in range(k)]
        front = new[:k]
    c = len(par)
    logp = -(3 * torch.rand(b, c, generator=g)) * (torch.rand(b, c, generator=g) < 0.6)  # 40% exact zeros
    scores = torch.empty(b, c)
    for i in range(c):  # cumulative: a child with log-probability 0 ties its parent exactly
        scores[:, i] = (scores[:, par[i]] if par[i] >= 0 else torch.full((b,), -20.0)) + logp[:, i]
    for n in range(2, c + 1):
        prop = select_tree(torch.zeros(b, dtype=torch.long), torch.arange(c).expand(b, c) + 1,
                           torch.tensor(par).expand(b, c), scores, n, levels)
        kept = prop.tokens[:, 1:] - 1  # candidate ids
        assert (prop.parents[:, 1:] >= 0).all() and (prop.parents[:, 1:] < torch.arange(1, n)).all(), n
        cand_par = torch.tensor(par)[kept]  # kept node's parent candidate == candidate at its new parent
        got_par = torch.cat([torch.full((b, 1), -1), kept], 1).gather(1, prop.parents[:, 1:])
        assert torch.equal(cand_par, got_par), n
        worst_kept = scores.gather(1, kept).amin(1)
        dropped = torch.ones(b, c, dtype=torch.bool).scatter(1, kept, False)
        assert (scores.masked_fill(~dropped, -torch.inf).amax(1) <= worst_kept).all(), n


# ---- attention mask over cache slots -------------------------------------------------------------

def test_attn_meta_tree_mask_with_pending():
    """The drafter's second level: 3 nodes already pending in the block, 3 new ones whose parents
    are pending nodes 0, 0 and 2 (row 0) or 1, 2, 2 (row 1); each sees the prefix, its parent, itself."""
    lens = torch.tensor([2, 4])
    tree = as_bool([[[1, 0, 0, 1, 0, 0], [1, 0, 0, 0, 1, 0], [0, 0, 1, 0, 0, 1]],
                    [[0, 1, 0, 1, 0, 0], [0, 0, 1, 0, 1, 0], [0, 0, 1, 0, 0, 1]]])
    positions = lens[:, None] + 1  # depth 2 nodes
    meta = AttnMeta.build(lens, positions.expand(2, 3), kv_len=4 + 3 + 3, tree_mask=tree, pending=3)
    assert meta.slots.tolist() == [[5, 6, 7], [7, 8, 9]]
    expected = as_bool([[[1, 1, 1, 0, 0, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 1, 0, 0, 0],
                         [1, 1, 0, 0, 1, 0, 0, 1, 0, 0]],
                        [[1, 1, 1, 1, 0, 1, 0, 1, 0, 0], [1, 1, 1, 1, 0, 0, 1, 0, 1, 0],
                         [1, 1, 1, 1, 0, 0, 1, 0, 0, 1]]])
    assert torch.equal(meta.mask[:, 0], expected)


def test_attn_meta_default_is_causal_after_pending():
    meta = AttnMeta.build(torch.tensor([2]), torch.tensor([[3, 4]]), kv_len=6, pending=1)
    assert meta.slots.tolist() == [[3, 4]]
    assert torch.equal(meta.mask[0, 0], as_bool([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]]))


# ---- one round of the real loop with a hand-built tree --------------------------------------------

class FixedTree:
    """A drafter proposing the same hand-built tree every round (column 0 replaced by the root)."""
    taps = ()
    graphable = True

    def __init__(self, tokens: torch.Tensor, parents: list[int]):
        self.tokens, self.parents = tokens, torch.tensor([parents] * len(tokens))

    def start(self, batch, taps, first):
        pass

    def start_host(self, rows, prompts, first):
        pass

    def propose(self, roots, sampling=None):
        tokens = self.tokens.clone()
        tokens[:, 0] = roots
        return DraftProposal.from_parents(tokens, self.parents)

    def commit(self, prop, res, taps):
        self.res = res

    def commit_host(self, emitted):
        pass


@pytest.fixture(scope="module")
def model(tiny_dirs):
    return load_model(tiny_dirs["llama3"][0], dtype="float32", device="cpu", tokenizer=False).model


@torch.inference_mode()
def test_verify_round_commits_accepted_path(model):
    v = model.config.vocab_size
    prompts = [torch.randint(3, v, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 6)]
    greedy = []  # g1..g4: the target's greedy continuation of each prompt
    for p in prompts:
        seq = p.clone()
        for _ in range(4):
            nxt = int(recompute(model, seq[:-1], int(seq[-1]))[1].argmax())
            seq = torch.cat([seq, torch.tensor([nxt])])
        greedy.append(seq[len(p):].tolist())
    (_, a2, a3, a4), (_, b2, b3, _) = greedy
    w = lambda t: (t + 1) % v  # noqa: E731  a token the target does not pick
    parents = [-1, 0, 0, 1, 2, 2]  # root; 1, 2 under it; 3 under 1; 4, 5 under 2
    tokens = torch.tensor([[0, w(a2), a2, a3, w(a3), a3],  # accepts 0 -> 2 -> 5 (a second child)
                           [0, b2, w(b2), w(b3), b3, b3]])  # accepts 0 -> 1; b3 only under a wrong parent
    spec = SpecConfig("ngram", steps=2, topk=2, draft_tokens=6)
    dec = spec_decoder(model, FixedTree(tokens, parents), spec, 2, 32)
    roots = dec.slots.last  # each row's last emitted token
    seen = []
    hook = model.register_forward_pre_hook(lambda m, args: seen.append(args[1].clone()))
    try:
        lens = [len(p) for p in prompts]
        assert dec.admit([0, 1], [p.tolist() for p in prompts]) == [[g[0]] for g in greedy]
        emitted = dec.step([10, 10])
    finally:
        hook.remove()
    assert emitted == [[a2, a3, a4], [b2, b3]]
    res = dec.current.drafter.res
    assert res.path.tolist() == [[0, 2, 5], [0, 1, 0]] and res.count.tolist() == [3, 2]
    assert roots.tolist() == [a4, b3]
    # the verify forward placed every node at prefix length + depth
    assert seen[1].tolist() == [[n + d for d in (0, 1, 1, 2, 2, 2)] for n in lens]
    # the cache now holds prompt + root + accepted drafts, as if computed from scratch
    got = run(model, dec.cache, roots[:, None])[:, -1]
    for b, (p, g) in enumerate(zip(prompts, greedy)):
        kept = torch.cat([p, torch.tensor(g[:res.count[b]])])
        ref, ref_logits = recompute(model, kept, int(roots[b]))
        assert_same_prefix(dec.cache, b, ref, len(kept))
        assert (got[b] - ref_logits).abs().max() <= 1e-5


def test_cut_to_the_limit():
    count, tokens = torch.tensor([4, 2]), torch.tensor([[11, 12, 13, 14], [21, 22, 0, 0]])
    n, bonus = cut(count, tokens, torch.tensor([2, 5]))
    assert n.tolist() == [2, 2] and bonus.tolist() == [12, 22]
    n, bonus = cut(count, tokens, torch.tensor([0, 1]))  # 0 freezes a row
    assert n.tolist() == [0, 1] and bonus.tolist() == [11, 21]


# ---- n-gram drafter -----------------------------------------------------------------------------

def ngram(steps=3, topk=1, **kw) -> SpecConfig:
    return SpecConfig("ngram", steps=steps, topk=topk, draft_tokens=None if topk == 1 else steps + topk, **kw)


def conts_of(hist: list[int], spec: SpecConfig, want: int, width: int = 24) -> list[list[int]]:
    """`continuations` of one history, as lists (existing tokens only, empty ones dropped)."""
    h = torch.zeros(1, width, dtype=torch.long)
    h[0, :len(hist)] = torch.tensor(hist)
    toks, ok = continuations(h, torch.tensor([len(hist)]), spec.ngram_min, spec.ngram_max, spec.steps, want)
    return [t[o].tolist() for t, o in zip(toks[0], ok[0]) if o.any()]


def reference_continuations(hist: list[int], spec: SpecConfig, want: int) -> list[list[int]]:
    """The lookup written plainly: the longest suffix (ngram_max down to ngram_min tokens) with an
    earlier occurrence followed by at least one token; the tokens after its `want` most recent ones."""
    for n in range(min(spec.ngram_max, len(hist) - 1), spec.ngram_min - 1, -1):
        at = [i for i in range(len(hist) - n - 1, -1, -1) if hist[i:i + n] == hist[len(hist) - n:]][:want]
        if at:
            return [hist[i + n:i + n + spec.steps] for i in at]
    return []


def reference_trie(conts: list[list[int]], budget: int) -> tuple[list[int], list[int]]:
    """Continuations merged into a trie below node 0, numbered breadth first (depth, then the
    continuation that made the node), cut to budget - 1: (tokens, parents) of the kept nodes."""
    nodes: dict[tuple[int, ...], tuple[int, int, int]] = {}  # prefix -> (depth, maker, token)
    for c, cont in enumerate(conts):
        for d in range(len(cont)):
            nodes.setdefault(tuple(cont[:d + 1]), (d, c, cont[d]))
    order = sorted(nodes, key=lambda p: nodes[p][:2])[:budget - 1]
    ids = {p: i + 1 for i, p in enumerate(order)}
    return [nodes[p][2] for p in order], [ids.get(p[:-1], 0) for p in order]


def test_continuations_longest_suffix_wins():
    # [1, 2, 3] occurred at 0 (then 9, 7, 3); the 1-gram [3] occurred later, at 5 (then 5, 1, 2)
    hist = [1, 2, 3, 9, 7, 3, 5, 1, 2, 3]
    assert conts_of(hist, ngram(), 1) == [[9, 7, 3]]
    assert conts_of(hist, ngram(ngram_max=1), 1) == [[5, 1, 2]]
    assert conts_of([1, 2, 3], ngram(), 1) == []  # nothing earlier matches
    assert conts_of([4, 1, 2, 5, 2], ngram(ngram_min=2), 1) == []  # 1-gram [2] not allowed
    assert conts_of([7, 7, 7], ngram(), 1) == [[7]]  # a continuation cut by the history's end


def test_continuations_most_recent_first():
    hist = [4, 5, 6, 4, 5, 7, 4, 5, 8, 4, 5]
    assert conts_of(hist, ngram(steps=2, topk=3), 3) == [[8, 4], [7, 4], [6, 4]]
    assert conts_of(hist, ngram(steps=2, topk=3), 2) == [[8, 4], [7, 4]]
    assert conts_of(hist, ngram(steps=2), 1) == [[8, 4]]
    assert conts_of([4, 5, 6, 4, 5, 6, 4, 5], ngram(steps=2, topk=2, ngram_max=2), 2) == [[6, 4], [6, 4]]  # repeats stay


def test_continuations_match_the_plain_lookup():
    """Random histories over few tokens (many recurring suffixes), several rows of different lengths
    in one call, every n-gram range: the device lookup equals the plain one."""
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        spec = ngram(steps=1 + trial % 4, topk=1 + trial % 3, ngram_min=1 + trial % 2, ngram_max=2 + trial % 3)
        want = spec.topk
        lens = torch.randint(1, 30, (5,), generator=g)
        hist = torch.randint(0, 4, (5, 32), generator=g)
        toks, ok = continuations(hist, lens, spec.ngram_min, spec.ngram_max, spec.steps, want)
        for r in range(5):
            got = [t[o].tolist() for t, o in zip(toks[r], ok[r]) if o.any()]
            assert got == reference_continuations(hist[r, :lens[r]].tolist(), spec, want), (trial, r)


def test_trie_merges_prefixes_breadth_first():
    c = torch.tensor([[[5, 6, 7], [5, 6, 8], [9, 6, 0]]])
    ok = torch.tensor([[[1, 1, 1], [1, 1, 1], [1, 1, 0]]]).bool()
    tokens, parents, valid = trie(c, ok, 7)
    assert tokens[0, 1:].tolist() == [5, 9, 6, 6, 7, 8] and parents[0].tolist() == [-1, 0, 0, 1, 2, 3, 3]
    tokens, parents, valid = trie(c, ok, 4)  # root + 3, cut in breadth order
    assert tokens[0, 1:].tolist() == [5, 9, 6] and parents[0, 1:].tolist() == [0, 0, 1] and valid.all()
    tokens, parents, valid = trie(c, ok, 10)  # room for more than there is: padding, not valid
    assert valid[0].tolist() == [True] * 7 + [False] * 3
    tokens, parents, valid = trie(torch.tensor([[[3, 4], [3, 4]]]), torch.ones(1, 2, 2, dtype=torch.bool), 5)
    assert tokens[0, 1:3].tolist() == [3, 4] and parents[0, 1:3].tolist() == [0, 1]  # repeats merge completely
    assert valid[0].tolist() == [True, True, True, False, False]


def test_trie_matches_the_plain_merge():
    g = torch.Generator().manual_seed(1)
    for trial in range(40):
        c, s, budget = 1 + trial % 4, 1 + trial % 5, 2 + trial % 9
        conts = torch.randint(0, 3, (3, c, s), generator=g)
        ok = torch.arange(s)[None, None] < torch.randint(0, s + 1, (3, c, 1), generator=g)
        tokens, parents, valid = trie(conts, ok, budget)
        for r in range(3):
            ref_t, ref_p = reference_trie([t[o].tolist() for t, o in zip(conts[r], ok[r])], budget)
            n = len(ref_t)
            assert valid[r].tolist() == [True] * (n + 1) + [False] * (budget - n - 1), trial
            assert tokens[r, 1:n + 1].tolist() == ref_t and parents[r, 1:n + 1].tolist() == ref_p, trial


def test_ngram_drafter_pads_its_proposal():
    drafter = NgramDrafter(ngram(steps=2, topk=2), 1, 32)
    start_rows(drafter, [0], [[4, 5, 6, 4, 5, 7, 4]], None, torch.tensor([5]))  # history ... 4, 5
    prop = drafter.propose(torch.tensor([5]), None)
    # matches of [4, 5] (most recent first): then 7, 4 and then 6, 4; draft_tokens 4 = root + 3
    assert prop.tokens[0].tolist() == [5, 7, 6, 4] and prop.parents[0].tolist() == [-1, 0, 0, 1]
    assert prop.depth[0].tolist() == [0, 1, 1, 2] and prop.valid.all()
    tokens = torch.tensor([[9, 0, 0]])  # the step emitted 9 alone: history ... 4, 5, 9
    drafter.commit(prop, VerifyResult(torch.zeros(1, 3, dtype=torch.long), torch.tensor([1]), tokens, tokens[:, 0]), None)
    assert drafter.lens.tolist() == [9] and drafter.hist[0, :9].tolist() == [4, 5, 6, 4, 5, 7, 4, 5, 9]
    prop = drafter.propose(torch.tensor([9]), None)  # no earlier 9: nothing to propose
    assert prop.tokens[0, 0] == 9 and prop.valid[0].tolist() == [True, False, False, False]


def test_ngram_row_views_share_the_history():
    drafter = NgramDrafter(ngram(steps=2), 3, 16)
    start_rows(drafter, [0, 1, 2], [[1, 2, 1], [3, 3], [5]], None, torch.tensor([2, 3, 6]))
    view = drafter.rows(2)
    tokens = torch.tensor([[7, 8, 0], [4, 0, 0]])
    view.commit(None, VerifyResult(torch.zeros(2, 3, dtype=torch.long), torch.tensor([2, 1]), tokens, tokens[:, 0]), None)
    assert drafter.lens.tolist() == [6, 4, 2] and drafter.hist[0, :6].tolist() == [1, 2, 1, 2, 7, 8]
    assert drafter.hist[1, :4].tolist() == [3, 3, 3, 4] and drafter.hist[2, :2].tolist() == [5, 6]
    prop = drafter.propose(torch.tensor([8, 4, 6]), None)
    assert prop.tokens.tolist()[2] == [6, 0, 0] and prop.valid.tolist()[2] == [True, False, False]
