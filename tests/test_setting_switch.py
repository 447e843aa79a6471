"""One drafter serving several speculation settings (serve --spec-switch, server/steps.py): a batch
that moves between chains and trees in place, between any two steps and with steps in flight,
emits exactly what plain greedy decoding does, for EAGLE-3, n-gram and draft-model drafters, and its draft
counters run on across the moves."""
from __future__ import annotations

import pytest
import torch

from eaglet.config import SpecConfig
from eaglet.generate import GenerationConfig, Generator
from eaglet.runtime.decoder import Decoder
from eaglet.server.policy import SpecPolicy
from eaglet.server.steps import setting_step, widest
from eaglet.spec.speculator import Speculator, load_speculator

from .serving import PROMPTS

SETTINGS = ["tree:3,2,6", "chain:1", "chain:4", "tree:2,3,8"]
NEW = 24


@pytest.mark.parametrize("method", ["eagle3", "ngram", "draft"])
@pytest.mark.parametrize("lookahead", [False, True])
def test_moving_between_settings_keeps_greedy_output(tiny, drafter_dir, method, lookahead):
    spec = SpecConfig(method, draft=str(drafter_dir) if method == "eagle3" else None, steps=3)
    # the draft model: the target itself, whose drafts are all accepted
    sp = Speculator(spec, draft_model=tiny.model) if method == "draft" else load_speculator(spec, tiny.model, tiny.path)
    policy = SpecPolicy(sp, {1: SETTINGS[0], 2: SETTINGS[1], 4: SETTINGS[2], 8: SETTINGS[3]}, switch=True)
    wide = widest(policy, SETTINGS)
    assert (wide.steps, wide.topk, wide.draft_tokens) == (4, 3, 8)
    prompts = [tiny.tokenizer.encode(p + " " + p) for p in PROMPTS[:3]]  # repeats: the n-gram drafter finds some
    want = [c.tokens for c in Generator(tiny.model, tiny.tokenizer).generate(prompts, GenerationConfig(NEW, ignore_eos=True))]

    max_len = 64
    dec = Decoder(tiny.model, 3, max_len + wide.draft_tokens, graphs=False, lookahead=lookahead)
    steps = {}
    for s in SETTINGS:
        steps[s] = setting_step(policy, tiny.model, dec.slots, max_len, s, s, steps, SETTINGS, shared=True)
    first = steps[SETTINGS[0]]
    state = lambda st: getattr(st.drafter, st.drafter.row_tensors[0]).data_ptr()  # noqa: E731
    assert all(state(st) == state(first) and st.counters is first.counters for st in steps.values())
    dec.use(first)
    got = dec.admit([0, 1, 2], prompts)
    dec.set_rows([0, 1, 2], [NEW - 1] * 3)
    for i in range(40):  # a move every step or two, some with a step in flight
        if i % 3 != 2:
            for done in dec.use(steps[SETTINGS[i % len(SETTINGS)]]):
                got = [g + d for g, d in zip(got, done)]
        new = dec.advance([NEW - len(g) for g in got])
        got = [g + n for g, n in zip(got, new or [[]] * 3)]
    for done in dec.use(dec.plain):
        got = [g + d for g, d in zip(got, done)]
    assert got == want
    drafts = first.counters.every()
    assert all(m.drafts > 0 for m in drafts[:3])
    if method == "ngram":
        assert sum(m.accepted_tokens for m in drafts[:3]) > 0  # drafts were accepted across the moves
    elif method == "draft":  # every draft accepted, whichever setting drafted it
        # (but where the token budget cuts the last step)
        assert all(sum(m.accepted_per_pos) >= sum(m.drafts_reaching_pos) - 1 and m.drafts >= 5 for m in drafts[:3])
    else:  # the drafter's cache holds what one setting alone would have absorbed (the committed positions)
        alone = Decoder(tiny.model, 3, max_len + wide.draft_tokens, graphs=False, lookahead=lookahead)
        one = setting_step(policy, tiny.model, alone.slots, max_len, "chain:1", "chain:1", {}, SETTINGS, shared=False)
        alone.use(one)
        ref = alone.admit([0, 1, 2], prompts)
        alone.set_rows([0, 1, 2], [NEW - 1] * 3)
        while any(len(r) < NEW for r in ref):
            ref = [r + n for r, n in zip(ref, alone.step([NEW - len(r) for r in ref]))]
        a, b = first.drafter.cache, one.drafter.cache
        n = int(min(a.lens.min(), b.lens.min()))
        assert n > len(max(prompts, key=len)) + NEW // 2
        torch.testing.assert_close(a.kv[..., :n, :], b.kv[..., :n, :], rtol=1e-4, atol=1e-5)
