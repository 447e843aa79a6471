"""The EAGLE-3 training-time test (eaglet/train/ttt.py) on the CPU: its visibility mask and shifts, the
loss of one step against a hand computation (non-draftable positions carry none), the 0.8^k decay of
later steps, TTTAttention against SDPA with the full mask (forward and gradients), and the targets
the head is trained toward (from hidden states as from logits; sharpened and hard labels)."""
import pytest
import torch
import torch.nn.functional as F

from eaglet.spec.drafters.eagle3_head import Eagle3Config, Eagle3Head
from eaglet.train.ttt import Targets, shift, ttt_loss, ttt_mask
from eaglet.weights import load_model

from .test_train import run_head

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tiny_dirs):
    return load_model(tiny_dirs["llama3"][0], dtype="float32", device="cpu", tokenizer=False).model


def test_ttt_mask_and_shift():
    m = ttt_mask(4, 2, "cpu")
    assert m.shape == (4, 12) and m.dtype == torch.bool
    assert torch.equal(m[:, :4], torch.ones(4, 4, dtype=torch.bool).tril())  # step 0: causal
    for j in (1, 2):  # each later step: its own index only
        assert torch.equal(m[:, 4 * j:4 * (j + 1)], torch.eye(4, dtype=torch.bool))
    assert torch.equal(ttt_mask(3, 0, "cpu"), torch.ones(3, 3, dtype=torch.bool).tril())
    assert shift(torch.tensor([[1, 2, 3, 4]]), 2).tolist() == [[3, 4, 0, 0]]
    assert shift(torch.tensor([[True, True, True]]), 1, False).tolist() == [[True, True, False]]


def test_ttt_loss_one_step_by_hand(target):
    torch.manual_seed(3)
    vd, b, t, vocab = 40, 2, 10, target.config.vocab_size
    head = Eagle3Head(Eagle3Config.for_target(target.config, draft_vocab_size=vd))
    head.set_vocab(torch.randperm(vocab)[:vd].sort().values)
    draft = head.draft_to_target()
    outside = next(i for i in range(vocab) if i not in set(draft.tolist()))
    embed = target.model.embed_tokens.weight
    taps = torch.randn(b, t, 3 * target.config.hidden_size)
    logits = 3 * torch.randn(b, t, vocab)
    logits[..., draft] += 10  # the target's choice is draftable ...
    logits[0, 4, outside] = 100.0  # ... except at index 4
    ids = torch.randint(0, vocab, (b, t))
    mask = torch.zeros(b, t, dtype=torch.bool)
    mask[0, 3:] = True
    mask[1, 5:9] = True  # index 9: padding

    out = ttt_loss(head, embed, taps, logits, ids, mask, steps=1)

    with torch.no_grad():  # predict x[t+2] from (taps[t], x[t+1]) against the target's distribution at t+1
        h = run_head(head, F.embedding(ids[:, 1:], embed), head.fc(taps[:, :-1]))  # (B, T-1, H)
        logp = head.logits(h).log_softmax(-1)
        p = logits[..., draft].softmax(-1)
        terms, hits = [], []
        for r in range(b):
            for i in range(t - 2):
                if mask[r, i + 2] and int(logits[r, i + 1].argmax()) in set(draft.tolist()):
                    terms.append(-(p[r, i + 1] * logp[r, i]).sum())
                    hits.append(int(logp[r, i].argmax()) == int(p[r, i + 1].argmax()))
    assert out.tokens == len(terms) == 10  # row 0: t = 1..7 but 3 (not draftable); row 1: t = 3..6
    assert torch.allclose(out.loss, torch.stack(terms).mean(), rtol=1e-5, atol=1e-6)
    assert out.step_loss[0] == pytest.approx(float(out.loss.detach()), rel=1e-6)
    assert out.step_acc[0] == pytest.approx(sum(hits) / len(hits))
    assert out.loss.requires_grad

    # the non-draftable position carries no loss: its distribution can change freely ...
    moved = logits.clone()
    moved[0, 4, draft] = 5 * torch.randn(vd)
    assert torch.equal(ttt_loss(head, embed, taps, moved, ids, mask, steps=1).loss, out.loss)
    # ... while the same change at a loss-carrying position does change the loss
    moved = logits.clone()
    moved[0, 5, draft] = 5 * torch.randn(vd)
    assert not torch.equal(ttt_loss(head, embed, taps, moved, ids, mask, steps=1).loss, out.loss)


def test_ttt_later_steps_decay():
    """steps=k sums 0.8^j-weighted per-step losses; step 0 is the same as with steps=1."""
    torch.manual_seed(4)
    from eaglet.config import ModelConfig

    tcfg = ModelConfig.from_hf(dict(model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=24,
                                    num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1))
    head = Eagle3Head(Eagle3Config.for_target(tcfg))
    embed, taps, logits = torch.randn(32, 16), torch.randn(1, 8, 48), torch.randn(1, 8, 32)
    ids, mask = torch.randint(0, 32, (1, 8)), torch.ones(1, 8, dtype=torch.bool)
    one = ttt_loss(head, embed, taps, logits, ids, mask, steps=1)
    three = ttt_loss(head, embed, taps, logits, ids, mask, steps=3)
    assert three.step_loss[0] == pytest.approx(one.step_loss[0], rel=1e-6) and len(three.step_loss) == 3
    assert float(three.loss.detach()) == pytest.approx(sum(0.8 ** k * s for k, s in enumerate(three.step_loss)), rel=1e-5)


def test_ttt_attention_equals_the_masked_attention():
    """TTTAttention (causal scores plus diagonals) equals SDPA over all steps' keys with the
    (T, (k+1)T) mask of ttt_mask, step by step, forward and gradients, grouped-query heads."""
    from eaglet.kvcache import AppendKV
    from eaglet.train.ttt import TTTAttention

    g = torch.Generator().manual_seed(0)
    b, hkv, grp, t, d, steps = 2, 2, 3, 9, 16, 4
    qs = [torch.randn(b, hkv * grp, t, d, generator=g, requires_grad=True) for _ in range(steps)]
    ks = [torch.randn(b, hkv, t, d, generator=g, requires_grad=True) for _ in range(steps)]
    vs = [torch.randn(b, hkv, t, d, generator=g, requires_grad=True) for _ in range(steps)]
    fast, cache = TTTAttention(), AppendKV(1)
    mine, ref = [], []
    for k in range(steps):
        kv = torch.stack([ks[k], vs[k]], 1).permute(0, 3, 1, 2, 4)  # (B, T, 2, Hkv, D) as RoPE hands it
        q = qs[k].reshape(b, hkv, grp * t, d)  # grouped-query heads folded as in Attention.forward
        mine.append(fast.attend(0, q, kv))
        keys, vals = cache.append(0, kv)  # (B, Hkv, (k+1)T, D)
        mask = ttt_mask(t, k, "cpu").repeat(grp, 1)  # (G*T, (k+1)T)
        ref.append(F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask).reshape(b, hkv * grp, t, d))
        assert torch.allclose(mine[k], ref[k], atol=1e-5), k
    leaves = qs + ks + vs
    w = [torch.randn(o.shape, generator=g) for o in mine]
    g_mine = torch.autograd.grad(sum((o * wi).sum() for o, wi in zip(mine, w)), leaves)
    g_ref = torch.autograd.grad(sum((o * wi).sum() for o, wi in zip(ref, w)), leaves)
    assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(g_mine, g_ref))


def test_targets_from_hidden_equal_those_from_logits(target):
    torch.manual_seed(5)
    head = Eagle3Head(Eagle3Config.for_target(target.config, draft_vocab_size=40))
    head.set_vocab(torch.randperm(128)[:40].sort().values)
    hidden = 3 * torch.randn(3, 7, target.config.hidden_size)
    a = Targets.from_hidden(head, hidden, target.lm_head.weight)
    b = Targets.from_logits(head, target.logits(hidden))
    assert torch.allclose(a.p, b.p, atol=1e-6) and torch.equal(a.arg, b.arg)
    assert torch.equal(a.in_vocab, b.in_vocab) and 0 < int(a.in_vocab.sum()) < 21  # both kinds occur
    full = Eagle3Head(Eagle3Config.for_target(target.config))  # the whole vocabulary: everything is draftable
    assert bool(Targets.from_hidden(full, hidden, target.lm_head.weight).in_vocab.all())


def test_sharpened_targets(target):
    """target_temperature: 1 is the target's distribution, below 1 the same argmax with more mass on
    it, 0 all of it (hard labels); from the hidden states as from the logits."""
    torch.manual_seed(6)
    head = Eagle3Head(Eagle3Config.for_target(target.config, draft_vocab_size=40))
    head.set_vocab(torch.randperm(128)[:40].sort().values)
    hidden = 3 * torch.randn(2, 5, target.config.hidden_size)
    logits = target.logits(hidden)
    soft, half, hard = (Targets.from_logits(head, logits, t) for t in (1.0, 0.5, 0.0))
    assert torch.allclose(soft.p, Targets.from_logits(head, logits).p)
    assert torch.equal(half.p.argmax(-1), soft.arg) and bool((half.p.amax(-1) > soft.p.amax(-1)).all())
    assert torch.equal(hard.p, F.one_hot(soft.arg, 40).float())
    for t in (0.5, 0.0):
        assert torch.allclose(Targets.from_hidden(head, hidden, target.lm_head.weight, t).p,
                              Targets.from_logits(head, logits, t).p, atol=1e-6)
