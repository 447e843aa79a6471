"""KVCache bookkeeping (advance, keeping an accepted subset, truncate) against recomputation from scratch: after committing
some of the tokens of a block (a causal block or a draft tree), the cache and the logits of the next
token must equal those of a fresh cache fed the prompt plus the committed tokens only."""
import pytest
import torch

from eaglet.kvcache import KVCache, keep_slots
from eaglet.models.attention import AttnMeta
from eaglet.weights import load_model

TOL = 1e-5
MAX_LEN = 64
# a 6-node draft tree: 0 is the root; 1, 2 its children; 3 under 1; 4 and 5 under 2
PARENTS = [-1, 0, 0, 1, 2, 2]
PATH = [0, 2, 5]  # root -> 2 -> 5


def keep(cache: KVCache, index: torch.Tensor, count: torch.Tensor) -> None:
    """Commit the tokens at block offsets index[b, :count[b]], as the speculation step does
    (spec/loop.py's settle: the moves from keep_slots, then the new lengths)."""
    cache.keep(*keep_slots(cache.lens, index, count))
    cache.lens += count


def tree_mask_and_depth(parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, T) bool mask, t sees u iff u is t or an ancestor of t; and each node's depth."""
    t = len(parents)
    mask = torch.zeros(t, t, dtype=torch.bool)
    depth = torch.zeros(t, dtype=torch.long)
    for i in range(t):
        j = i
        while j >= 0:
            mask[i, j] = True
            depth[i] += j != i
            j = parents[j]
    return mask, depth


def run(model, cache: KVCache, ids: torch.Tensor, positions=None, tree_mask=None) -> torch.Tensor:
    """Forward new tokens (B, T) after each sequence's committed length; does not commit. -> logits."""
    t = ids.shape[1]
    if positions is None:
        positions = cache.lens[:, None] + torch.arange(t)
    meta = AttnMeta.build(cache.lens, positions, int(cache.lens.max()) + t, tree_mask=tree_mask)
    hidden, _ = model(ids, positions, cache, meta)
    return model.logits(hidden)


def new_cache(model, batch: int) -> KVCache:
    return KVCache.for_model(model.config, batch, MAX_LEN, torch.float32, "cpu")


def prefill(model, prompts: list[torch.Tensor]) -> KVCache:
    """A cache holding the (ragged, right-padded) prompts, committed."""
    cache = new_cache(model, len(prompts))
    t = max(len(p) for p in prompts)
    ids = torch.stack([torch.cat([p, torch.zeros(t - len(p), dtype=torch.long)]) for p in prompts])
    run(model, cache, ids)
    cache.advance(torch.tensor([len(p) for p in prompts]))
    return cache


def recompute(model, tokens: torch.Tensor, nxt: int) -> tuple[KVCache, torch.Tensor]:
    """From scratch: (a fresh cache holding `tokens`, committed; the logits of `nxt` after them)."""
    cache = prefill(model, [tokens])
    logits = run(model, new_cache(model, 1), torch.cat([tokens, torch.tensor([nxt])])[None])[0, -1]
    return cache, logits


def assert_same_prefix(cache: KVCache, row: int, ref: KVCache, n: int) -> None:
    assert int(cache.lens[row]) == n == int(ref.lens[0])
    assert (cache.k[:, row, :, :n] - ref.k[:, 0, :, :n]).abs().max() <= TOL
    assert (cache.v[:, row, :, :n] - ref.v[:, 0, :, :n]).abs().max() <= TOL


@pytest.fixture(scope="module")
def model(tiny_dirs):
    return load_model(tiny_dirs["llama3"][0], dtype="float32", device="cpu", tokenizer=False).model


def rand_ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def test_tree_keep_path_equals_recomputation(model):
    prompt, block, nxt = rand_ids(9, 0), rand_ids(6, 1), 77
    mask, depth = tree_mask_and_depth(PARENTS)
    cache = prefill(model, [prompt])
    tree_logits = run(model, cache, block[None], cache.lens[:, None] + depth, tree_mask=mask[None])[0]
    keep(cache, torch.tensor([PATH]), torch.tensor([len(PATH)]))
    cache.sync_host()

    kept = torch.cat([prompt, block[PATH]])
    ref, ref_logits = recompute(model, kept, nxt)
    assert_same_prefix(cache, 0, ref, len(kept))
    got = run(model, cache, torch.tensor([[nxt]]))[0, -1]
    assert (got - ref_logits).abs().max() <= TOL
    # and the tree forward itself scored each path node as the plain sequence would
    ref_seq = run(model, new_cache(model, 1), kept[None])[0, len(prompt):]
    assert (tree_logits[PATH] - ref_seq).abs().max() <= TOL


@pytest.mark.parametrize("n_keep", [0, 1, 4, 6])
@torch.inference_mode()
def test_causal_block_keep_prefix_equals_recomputation(model, n_keep):
    prompt, block, nxt = rand_ids(7, 2), rand_ids(6, 3), 5
    cache = prefill(model, [prompt])
    run(model, cache, block[None])
    keep(cache, torch.arange(6)[None], torch.tensor([n_keep]))
    cache.sync_host()

    kept = torch.cat([prompt, block[:n_keep]])
    ref, ref_logits = recompute(model, kept, nxt)
    assert_same_prefix(cache, 0, ref, len(kept))
    got = run(model, cache, torch.tensor([[nxt]]))[0, -1]
    assert (got - ref_logits).abs().max() <= TOL


@torch.inference_mode()
def test_advance_commits_whole_block(model):
    prompt, block, nxt = rand_ids(5, 4), rand_ids(6, 5), 9
    cache = prefill(model, [prompt])
    run(model, cache, block[None])
    cache.advance(6)

    ref, ref_logits = recompute(model, torch.cat([prompt, block]), nxt)
    assert_same_prefix(cache, 0, ref, 11)
    assert (run(model, cache, torch.tensor([[nxt]]))[0, -1] - ref_logits).abs().max() <= TOL


@torch.inference_mode()
def test_batch_keep_different_counts(model):
    """Three sequences of different lengths keep 3, 0 and 2 tokens of their block; entries of the
    index past each count are junk and must be ignored."""
    prompts = [rand_ids(5, 6), rand_ids(11, 7), rand_ids(8, 8)]
    blocks = torch.stack([rand_ids(6, 9), rand_ids(6, 10), rand_ids(6, 11)])
    tree, depth = tree_mask_and_depth(PARENTS)
    chain, chain_depth = tree_mask_and_depth([-1, 0, 1, 2, 3, 4])  # row 2: a causal chain
    masks = torch.stack([tree, tree, chain])
    depths = torch.stack([depth, depth, chain_depth])
    index = torch.tensor([PATH, [4, 1, 3], [0, 1, 5]])
    count = torch.tensor([3, 0, 2])
    nxt = torch.tensor([[11], [22], [33]])

    cache = prefill(model, prompts)
    run(model, cache, blocks, cache.lens[:, None] + depths, tree_mask=masks)
    keep(cache, index, count)
    cache.sync_host()
    got = run(model, cache, nxt)[:, -1]

    for b, p in enumerate(prompts):
        kept = torch.cat([p, blocks[b, index[b, : count[b]]]])
        ref, ref_logits = recompute(model, kept, int(nxt[b]))
        assert_same_prefix(cache, b, ref, len(kept))
        assert (got[b] - ref_logits).abs().max() <= TOL, f"row {b}"


@torch.inference_mode()
def test_truncate_then_reappend_equals_recomputation(model):
    prompts = [rand_ids(10, 12), rand_ids(6, 13)]
    blocks, again = rand_ids(12, 14).view(2, 6), rand_ids(6, 15).view(2, 3)
    cache = prefill(model, prompts)
    run(model, cache, blocks)
    cache.advance(6)  # lens (16, 12)
    cache.truncate(torch.tensor([12, 20]))  # row 0 back by 4; a larger length is a no-op
    assert cache.lens.tolist() == [12, 12]
    logits = run(model, cache, again)
    cache.advance(3)

    for b, keep in enumerate([2, 6]):
        seq = torch.cat([prompts[b], blocks[b, :keep], again[b]])
        ref = new_cache(model, 1)
        ref_logits = run(model, ref, seq[None])[0, -3:]
        ref.advance(len(seq))
        assert_same_prefix(cache, b, ref, len(seq))
        assert (logits[b] - ref_logits).abs().max() <= TOL, f"row {b}"


def hand_filled(lens: list[int]) -> KVCache:
    """2 layers, 2 rows, 1 head, 8 slots, head_dim 1: k holds 100*layer + 10*row + slot, v = -k."""
    cache = KVCache(2, 2, 1, 8, 1, torch.float32, "cpu")
    code = (100 * torch.arange(2)[:, None, None] + 10 * torch.arange(2)[None, :, None]
            + torch.arange(8)[None, None, :]).float()  # (L, B, S)
    cache.k[:, :, 0, :, 0] = code
    cache.v[:, :, 0, :, 0] = -code
    cache.advance(torch.tensor(lens))  # as if `lens` tokens were committed
    return cache


def slots(cache: KVCache, row: int) -> list[list[int]]:
    """Per layer, the slot each cached entry came from (decoded from the hand-filled values)."""
    k = cache.k[:, row, 0, :, 0]
    assert torch.equal(cache.v[:, row, 0, :, 0], -k)
    return (k - 100 * torch.arange(2)[:, None] - 10 * row).long().tolist()


def test_keep_moves_exact_slots():
    cache = hand_filled([2, 3])
    # row 0: swap offsets 1 and 0 (needs gather-before-write); junk (99, -5) past count 2 is ignored
    # row 1: keep only offset 3 (slot 6 -> slot 3)
    keep(cache, torch.tensor([[1, 0, 99, -5], [3, 0, 0, 0]]), torch.tensor([2, 1]))
    assert cache.lens.tolist() == [4, 4]
    assert slots(cache, 0) == [[0, 1, 3, 2, 4, 5, 6, 7]] * 2
    assert slots(cache, 1) == [[0, 1, 2, 6, 4, 5, 6, 7]] * 2


def test_keep_count_zero_changes_nothing():
    cache = hand_filled([2, 5])
    keep(cache, torch.tensor([[3, 2, 1], [2, 1, 0]]), torch.tensor([0, 0]))
    assert cache.lens.tolist() == [2, 5]
    assert slots(cache, 0) == [list(range(8))] * 2
    assert slots(cache, 1) == [list(range(8))] * 2


def test_advance_and_truncate_lengths():
    cache = hand_filled([2, 3])
    cache.advance(2)
    cache.advance(torch.tensor([1, 0]))
    assert cache.lens.tolist() == [5, 5]
    cache.truncate(torch.tensor([3, 7]))  # never lengthens
    assert cache.lens.tolist() == [3, 5]
    cache.reset()
    assert cache.lens.tolist() == [0, 0]
