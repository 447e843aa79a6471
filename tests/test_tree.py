"""Draft trees on hand-built examples: ancestor masks and depth, the EAGLE-2 selection of the best
nodes, the attention mask over cache slots, one verify-accept-commit round of the real loop against
recomputation from scratch, the cut to a row's limit, and the n-gram drafter's matching and trie."""
import pytest
import torch

from eaglet.config import SpecConfig
from eaglet.models.attention import AttnMeta
from eaglet.sampling import SamplingParams
from eaglet.spec.drafters.base import start_rows
from eaglet.spec.drafters.ngram import NgramDrafter, build_trie, find_continuations
from eaglet.spec.loop import SpecDecoder
from eaglet.spec.tree import DraftProposal, ancestor_mask, chain, select_tree
from eaglet.spec.verify import cut
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
    q = torch.rand(1, 4, 11)
    prop = chain(tokens, q=q)
    assert prop.parents.tolist() == [[-1, 0, 1, 2]] and prop.depth.tolist() == [[0, 1, 2, 3]]
    assert torch.equal(prop.mask[0], torch.ones(4, 4, dtype=torch.bool).tril())
    assert prop.valid.all() and prop.q is q and prop.num_nodes == 4
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
    assert prop.valid.all() and prop.q is None
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

    def propose(self, roots):
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
    dec = SpecDecoder(model, FixedTree(tokens, parents), spec, 2, 32, SamplingParams())
    seen = []
    hook = model.register_forward_pre_hook(lambda m, args: seen.append(args[1].clone()))
    try:
        lens = [len(p) for p in prompts]
        assert dec.admit([0, 1], [p.tolist() for p in prompts]) == [[g[0]] for g in greedy]
        emitted = dec.step([10, 10])
    finally:
        hook.remove()
    assert emitted == [[a2, a3, a4], [b2, b3]]
    res = dec.drafter.res
    assert res.path.tolist() == [[0, 2, 5], [0, 1, 0]] and res.count.tolist() == [3, 2]
    assert dec.roots.tolist() == [a4, b3]
    # the verify forward placed every node at prefix length + depth
    assert seen[1].tolist() == [[n + d for d in (0, 1, 1, 2, 2, 2)] for n in lens]
    # the cache now holds prompt + root + accepted drafts, as if computed from scratch
    got = run(model, dec.cache, dec.roots[:, None])[:, -1]
    for b, (p, g) in enumerate(zip(prompts, greedy)):
        kept = torch.cat([p, torch.tensor(g[:res.count[b]])])
        ref, ref_logits = recompute(model, kept, int(dec.roots[b]))
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


def test_find_continuations_longest_suffix_wins():
    # [1, 2, 3] occurred at 0 (then 9, 7, 3); the 1-gram [3] occurred later, at 5 (then 5, 1, 2)
    hist = [1, 2, 3, 9, 7, 3, 5, 1, 2, 3]
    assert find_continuations(hist, ngram(), 1) == [[9, 7, 3]]
    assert find_continuations(hist, ngram(ngram_max=1), 1) == [[5, 1, 2]]
    assert find_continuations([1, 2, 3], ngram(), 1) == []  # nothing earlier matches
    assert find_continuations([4, 1, 2, 5, 2], ngram(ngram_min=2), 1) == []  # 1-gram [2] not allowed
    assert find_continuations([7, 7, 7], ngram(), 1) == [[7]]  # a continuation cut by the history's end


def test_find_continuations_most_recent_first():
    hist = [4, 5, 6, 4, 5, 7, 4, 5, 8, 4, 5]
    assert find_continuations(hist, ngram(steps=2, topk=3), 3) == [[8, 4], [7, 4], [6, 4]]
    assert find_continuations(hist, ngram(steps=2, topk=3), 2) == [[8, 4], [7, 4]]
    assert find_continuations(hist, ngram(steps=2), 1) == [[8, 4]]


def test_build_trie_merges_prefixes_breadth_first():
    conts = [[5, 6, 7], [5, 6, 8], [9, 6]]
    assert build_trie(conts, 100) == ([5, 9, 6, 6, 7, 8], [0, 0, 1, 2, 3, 3])
    assert build_trie(conts, 4) == ([5, 9, 6], [0, 0, 1])  # root + 3, cut in breadth order
    assert build_trie(conts, 1) == ([], [])
    assert build_trie([[3, 4], [3, 4]], 10) == ([3, 4], [0, 1])  # duplicates merge completely
    for budget in range(1, 8):  # never an orphan: every parent is the root or an earlier kept node
        toks, pars = build_trie(conts, budget)
        assert len(toks) == len(pars) == min(budget - 1, 6)
        assert all(0 <= p <= i for i, p in enumerate(pars))


def test_ngram_drafter_pads_its_proposal():
    drafter = NgramDrafter(ngram(steps=2, topk=2), 1)
    start_rows(drafter, [0], [[4, 5, 6, 4, 5, 7, 4]], None, torch.tensor([5]))  # history ... 4, 5
    prop = drafter.propose(torch.tensor([5]))
    # matches of [4, 5] (most recent first): then 7, 4 and then 6, 4; draft_tokens 4 = root + 3
    assert prop.tokens[0].tolist() == [5, 7, 6, 4] and prop.parents[0].tolist() == [-1, 0, 0, 1]
    assert prop.depth[0].tolist() == [0, 1, 1, 2] and prop.valid.all()
    drafter.commit_host([[9]])  # history ... 4, 5, 9: no earlier 9, nothing to propose
    prop = drafter.propose(torch.tensor([9]))
    assert prop.tokens[0, 0] == 9 and prop.valid[0].tolist() == [True, False, False, False]
