"""The drafter trainer's parts, each on its own: the draft vocabulary from token counts and its
coverage, the batch plan, a head moved to another vocabulary (Eagle3Head.with_vocab), and the target's
causal forward the trainer runs. The Trainer end to end: test_train.py."""
import random

import pytest
import torch

from eaglet.errors import InvalidInput
from eaglet.models.attention import AttnMeta
from eaglet.spec.drafters.eagle3_head import Eagle3Config, Eagle3Head
from eaglet.train.trainer import TrainConfig, batch_plan
from eaglet.train.vocab import coverage, most_frequent, token_counts
from eaglet.weights import load_model


@pytest.fixture(scope="module")
def target(tiny_dirs):
    return load_model(tiny_dirs["llama3"][0], dtype="float32", device="cpu", tokenizer=False).model


ROWS = [{"input_ids": [5, 5, 5, 1, 2, 2, 3], "prompt_len": 3},  # prompt tokens (5, 9) never count
        {"input_ids": [9, 9, 3, 7, 2, 7, 3], "prompt_len": 2}]  # assistant counts: 2:3 3:3 7:2 1:1


@pytest.mark.parametrize("size, ids", [(1, [2]), (3, [2, 3, 7]), (4, [1, 2, 3, 7]), (5, [0, 1, 2, 3, 7]),
                                       (99, list(range(10)))])
def test_draft_vocab_most_frequent_sorted(size, ids):
    v = most_frequent(token_counts(ROWS, 10), size)
    assert v.dtype == torch.long and v.tolist() == ids  # ties (2 vs 3; unseen ids) go to the lower id


def test_coverage():
    counts = token_counts(ROWS, 10)
    assert counts.tolist() == [0, 1, 3, 3, 0, 0, 0, 2, 0, 0]
    assert coverage(counts, torch.tensor([2, 3, 7])) == pytest.approx(8 / 9)
    assert coverage(counts, torch.tensor([5, 9])) == 0.0  # prompt-only ids cover nothing
    assert coverage(counts, torch.arange(10)) == 1.0


def test_batch_plan_covers_each_row_once_per_epoch():
    lengths = [5 + (i * 7) % 40 for i in range(100)]
    cfg = TrainConfig(data="-", out="-", batch_tokens=120, epochs=2.5, seed=1)
    plan = batch_plan(lengths, cfg)
    assert plan == batch_plan(lengths, cfg)  # a pure function of the seed
    assert all(len(bt) * max(lengths[i] for i in bt) <= 120 for bt in plan)
    one = batch_plan(lengths, TrainConfig(data="-", out="-", batch_tokens=120, epochs=1, seed=1))
    assert plan[:len(one)] == one and sorted(i for bt in one for i in bt) == list(range(100))
    assert len(one) * 2 < len(plan) < len(one) * 3  # two epochs and half of a third


def test_a_wider_length_window_pads_less_and_still_covers_each_row_once():
    lengths = [random.Random(i).randint(20, 600) for i in range(3000)]

    def plan(window):
        p = batch_plan(lengths, TrainConfig(data="-", out="-", batch_tokens=8192, length_window=window, seed=3))
        assert sorted(i for bt in p for i in bt) == list(range(3000))
        assert all(len(bt) * max(lengths[i] for i in bt) <= 8192 for bt in p)
        return len(p), sum(lengths) / sum(len(bt) * max(lengths[i] for i in bt) for bt in p)

    (steps_narrow, fill_narrow), (steps_wide, fill_wide) = plan(256), plan(3000)
    assert fill_wide > 0.95 > fill_narrow and steps_wide < steps_narrow
    with pytest.raises(InvalidInput, match="length-window"):
        TrainConfig(data="-", out="-", length_window=0)


def test_with_vocab_keeps_known_rows_and_fits_new_ones_from_the_targets_rows(target):
    """A head whose lm_head rows are mostly the target's output rows under a linear map: over another
    vocabulary (some ids dropped, some added) the rows of ids it had are kept, the added rows are the
    target's rows under the ridge fit of the head's rows, at the kept rows' scale, and every other
    weight is unchanged."""
    g = torch.Generator().manual_seed(3)
    head = Eagle3Head(Eagle3Config.for_target(target.config, draft_vocab_size=80))  # 80 rows fix a 64 x 64 map
    old = torch.randperm(128, generator=g)[:80].sort().values
    head.set_vocab(old)
    t = target.lm_head.weight.detach()
    fit = torch.randn(64, 64, generator=g) / 8
    with torch.no_grad():
        head.lm_head.weight.copy_(t[old] @ fit)
        head.lm_head.weight[::7] += 0.5  # rows off the map: kept as they are, not refitted
    missing = torch.tensor([i for i in range(128) if i not in old.tolist()])
    ids = torch.cat([old[10:], missing[:30]]).sort().values  # 10 dropped, 30 added
    new = head.with_vocab(ids, t)
    assert new.cfg.draft_vocab_size == 100 and torch.equal(new.draft_to_target(), ids)
    assert torch.equal(new.t2d.nonzero().flatten(), ids)
    kept = torch.isin(ids, old)
    assert torch.equal(new.lm_head.weight[kept], head.lm_head.weight[10:])
    w, to = head.lm_head.weight.detach(), t[old]
    gram = to.T @ to
    refit = torch.linalg.solve(gram + 0.1 * gram.diagonal().mean() * torch.eye(64), to.T @ w)
    assert torch.allclose(new.lm_head.weight[~kept], t[ids[~kept]] @ refit, atol=1e-5)
    # the ridge keeps added rows at the kept rows' scale, where a plain fit on 80 rows of 64 overshoots
    assert new.lm_head.weight[~kept].norm(dim=1).mean() < 1.5 * w.norm(dim=1).mean()
    assert torch.equal(new.fc.weight, head.fc.weight)
    assert torch.equal(new.midlayer.mlp.down_proj.weight, head.midlayer.mlp.down_proj.weight)


@pytest.mark.parametrize("family", ["llama3", "smollm2", "qwen3"])
def test_causal_target_forward_equals_the_masked_one(tiny_dirs, family):
    """The trainer's target forward (kvcache.Causal: SDPA is_causal, no mask tensor) gives the
    hidden states and taps of the general path (AppendKV with AttnMeta's causal mask), on
    right-padded rows, with grouped-query heads (2 kv heads of 4, and 1)."""
    from eaglet.kvcache import AppendKV, Causal

    model = load_model(tiny_dirs[family][0], dtype="float32", device="cpu", tokenizer=False).model
    ids = torch.randint(3, 128, (3, 21), generator=torch.Generator().manual_seed(1))
    ids[1, 15:] = 0  # padding after a shorter row
    pos = torch.arange(21).expand_as(ids)
    with torch.no_grad():
        h1, t1 = model(ids, pos, Causal(), None, capture=(0, 1))
        h2, t2 = model(ids, pos, AppendKV(model.config.num_layers),
                       AttnMeta.build(torch.zeros(3, dtype=torch.long), pos, 21), capture=(0, 1))
    torch.testing.assert_close(h1, h2, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(t1, t2, atol=2e-5, rtol=1e-5)
