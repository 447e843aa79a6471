"""The trainer and the engine must feed the EAGLE-3 head the same thing: the head's step-0 output
in the training-time test at index t equals the drafter's root logits after the engine committed
x[0..t+1] (prompt x[0..t], first sampled token x[t+1]); and step k of the training-time test equals
the engine's depth-(k+1) draft logits when the drafts are the true tokens; for one-layer heads and
for heads of two layers."""
import pytest
import torch

from eaglet.config import SpecConfig
from eaglet.kvcache import AppendKV, KVCache
from eaglet.models.attention import AttnMeta
from eaglet.spec.drafters.base import start_rows
from eaglet.spec.drafters.eagle3 import Eagle3Drafter
from eaglet.spec.drafters.eagle3_head import Eagle3Config, Eagle3Head
from eaglet.train import ttt
from eaglet.weights import load_model

T = 12


def ttt_logits(head, target, ids, steps):
    """Per-step head logits of the training-time test, recorded through a spy on head.logits."""
    with torch.no_grad():
        pos = torch.arange(T)[None]
        zeros = torch.zeros(1, dtype=torch.long)
        hidden, taps = target(ids, pos, AppendKV(target.config.num_layers), AttnMeta.build(zeros, pos, T),
                              capture=head.cfg.aux_layers)
        logits = target.logits(hidden)
        seen = []
        orig = head.forward  # the step's output at every index (the lm_head runs only where there is loss)
        head.forward = lambda *a: seen.append(orig(*a)) or seen[-1]
        try:
            ttt.ttt_loss(head, target.model.embed_tokens.weight, taps, logits, ids,
                         torch.ones_like(ids, dtype=torch.bool), steps=steps)
        finally:
            del head.forward
    return [head.logits(h) for h in seen]  # steps tensors (1, T, Vd)


@pytest.mark.parametrize("layers", [1, 2])  # 2: vLLM's later layer, its own keys in training and in the engine
@torch.inference_mode()
def test_training_and_engine_feed_the_head_alike(tiny_dirs, layers):
    target = load_model(tiny_dirs["llama3"][0], dtype="float32", device="cpu", tokenizer=False).model
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.for_target(target.config, draft_vocab_size=64, num_layers=layers)).eval()
    head.set_vocab(torch.arange(0, 128, 2))
    ids = 2 * torch.randint(0, 64, (1, T), generator=torch.Generator().manual_seed(3))  # all draftable
    steps = 3
    train_logits = ttt_logits(head, target, ids, steps)
    compared = 0
    for t in (2, 5, 7):
        prompt = ids[0, : t + 1].tolist()
        cache = KVCache.for_model(target.config, 1, 32, torch.float32, "cpu")
        pos = torch.arange(t + 1)[None]
        _, taps = target(torch.tensor([prompt]), pos, cache, AttnMeta.build(cache.lens, pos, t + 1),
                         capture=head.cfg.aux_layers)
        drafter = Eagle3Drafter(head, target, SpecConfig("eagle3", steps=steps), 1, 64)
        start_rows(drafter, [0], [prompt], taps, ids[0, t + 1: t + 2])
        root_logits, state = drafter.catch_up()
        assert torch.allclose(root_logits, train_logits[0][0, t], atol=1e-5), f"step 0 at t={t}"
        # deeper steps: feed the true next tokens as drafts, like the training-time test does
        for k in range(1, steps):
            if t + 1 + k >= T:
                break
            tok = head.t2d.nonzero()[:, 0]  # draft ids are positions in the draft vocabulary
            true = int(ids[0, t + 1 + k])
            d_id = torch.tensor([[tok.tolist().index(true)]])
            mask = torch.ones(1, 1, k, dtype=torch.bool)
            logits, out = drafter.draft_step(d_id, state[:, None], k, mask, pending=k - 1)
            state = out[:, 0]
            assert torch.allclose(logits[0, 0], train_logits[k][0, t], atol=1e-5), f"step {k} at t={t}"
            compared += 1
    assert compared == 6  # depths 2 and 3 at three positions
