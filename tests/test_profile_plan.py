"""Profile-mode planning: tree accept lengths predicted from a measured tree's trace, the choice of
setting, and the per-batch-size policy."""

import torch

from eaglet.config import SpecConfig
from eaglet.generate import GenerationConfig, Generator
from eaglet.perf.planner import batch_policy, candidates, choose
from eaglet.perf.profile import DraftTrace, tree_tau_table
from eaglet.spec.metrics import SpecMetrics
from eaglet.spec.speculator import Speculator
from eaglet.weights import load_model


def first_step_counts(model, spec: SpecConfig, prompts, draft) -> list:
    """The trace of the first speculation step from each prompt's state (same state for any spec)."""
    trace = DraftTrace()
    sp = Speculator(spec, draft_model=draft)
    Generator(model, None, sp, observer=trace).generate(prompts, GenerationConfig(max_new_tokens=40, ignore_eos=True))
    return trace.steps[:1]


@torch.inference_mode()
def test_smaller_trees_predicted_exactly_from_a_measured_tree(tiny_dirs):
    target = load_model(tiny_dirs["llama3"][0], dtype="float32", device="cpu", tokenizer=False).model
    small = load_model(tiny_dirs["qwen3"][0], dtype="float32", device="cpu", tokenizer=False).model  # other weights
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128, (int(n),), generator=g).tolist() for n in torch.randint(3, 12, (24,), generator=g)]
    for draft in (target, small):  # perfect and imperfect drafters
        big = first_step_counts(target, SpecConfig("draft", steps=4, topk=3, draft_tokens=24), prompts, draft)
        table = tree_tau_table(big, range(1, 5), (4, 8, 12, 24))
        assert table["4,24"] == sum(big[0][3]) / len(prompts)  # the measured tree itself
        for s, n in [(2, 4), (3, 8), (4, 12), (2, 8)]:
            got = first_step_counts(target, SpecConfig("draft", steps=s, topk=3, draft_tokens=n), prompts, draft)
            assert table[f"{s},{n}"] == sum(got[0][3]) / len(prompts), (s, n)


def profile(decode: dict[int, float], verify: dict[int, dict[int, float]]) -> dict:
    costs = [{"batch": b, "context": 256, "decode_ms": decode[b], "verify_ms": {str(k): v for k, v in verify[b].items()},
              "draft_ms": {"1": 0.5, "4": 0.8}} for b in decode]
    acc = {"chain": {"steps": 4, "accept_per_pos": [0.8, 0.6, 0.4, 0.2], "accept_length": 3.0, "drafts": 100,
                     "step_ms_measured": 0.5 * 4 + verify[1][5] + 1.0},
           "trees": {"4": {"steps": 4, "draft_tokens": 16, "accept_length": 3.4, "drafts": 100,
                           "tau": {"4,16": 3.4, "4,8": 3.2, "2,8": 2.5}}}}
    return {"costs": costs, "acceptance": acc, "acceptance_batch": 1}


def test_choice_and_batch_policy():
    p = profile({1: 10.0, 64: 12.0},
                {1: {1: 10.0, 2: 10.2, 3: 10.4, 4: 10.6, 5: 10.8, 8: 11.0, 16: 12.0},
                 64: {1: 12.0, 2: 22.0, 3: 28.0, 4: 36.0, 5: 44.0, 8: 70.0, 16: 140.0}})
    cands = {c.name: c for c in candidates(p, 1)}
    # overhead = measured chain step - modelled parts = 1.0 ms
    assert cands["chain:2"].tau == 2.4 and cands["chain:2"].step_ms == 2 * 0.5 + 10.4 + 1.0
    assert cands["tree:4,4,16"].step_ms == 4 * 0.8 + 12.0 + 1.0
    best, ranked = choose(p, 1)
    assert best is not None and best.speedup == max(c.speedup for c in ranked) and best.speedup > 1
    policy = batch_policy(p)
    assert policy[1] == best.name and policy[64] is None  # verify grows with batch: plain wins there
    p["acceptance"]["chain"]["accept_per_pos"] = [0.05, 0.0, 0.0, 0.0]
    p["acceptance"]["trees"]["4"]["tau"] = {"4,16": 1.05, "4,8": 1.04, "2,8": 1.03}
    assert choose(p, 1)[0] is None  # nothing pays: don't speculate


def test_verify_curve_measures_every_chain_length(tiny_dirs):
    """The CPU's verify cost is not smooth in the token count, so the profile measures each chain's
    count (1 .. steps + 1) instead of interpolating between powers of two."""
    from eaglet.perf.profile import VERIFY_TOKENS, measure_costs

    model = load_model(tiny_dirs["llama3"][0], dtype="float32", device="cpu", tokenizer=False).model
    sp = Speculator(SpecConfig("ngram", steps=5))
    c = measure_costs(model, sp, batch=1, context=16, topks=(1,), chain_steps=5)
    assert set(c["verify_ms"]) == {str(n) for n in set(VERIFY_TOKENS) | {3, 5, 6}}
    assert all(v > 0 for v in c["verify_ms"].values()) and c["decode_ms"] == c["verify_ms"]["1"]


def test_profile_prompts_spread_over_the_set(tmp_path):
    """`eaglet profile` measures acceptance on prompts spread over the set, not its first n (MT-bench's
    first 8 are all writing prompts); a ShareGPT file gives its first user turns."""
    import json

    from eaglet.datasets import load_prompts
    from eaglet.perf.plan_cmd import spread

    f = tmp_path / "sg.json"
    f.write_text(json.dumps([{"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "a"}]}
                             for i in range(6)] + [{"conversations": [{"from": "gpt", "value": "no user turn"}]}]))
    assert spread(load_prompts(str(f)), 3) == ["q0", "q2", "q4"]

    assert spread(list(range(80)), 8) == [0, 10, 20, 30, 40, 50, 60, 70]
    assert spread(list(range(5)), 8) == [0, 1, 2, 3, 4]
    assert spread(list(range(10)), 3) == [0, 3, 6]
    mt = load_prompts("mtbench")
    assert spread(mt, 8)[1] == mt[len(mt) // 8] and len(set(spread(mt, 8))) == 8


@torch.inference_mode()
def test_acceptance_is_timed_on_a_warm_second_pass(tiny_dirs, monkeypatch):
    """Each setting runs over the prompts twice and only the second pass counts: the first meets
    every attention span's graphs cold."""
    import eaglet.perf.profile as prof

    target = load_model(tiny_dirs["llama3"][0], dtype="float32", device="cpu", tokenizer=False).model
    small = load_model(tiny_dirs["qwen3"][0], dtype="float32", device="cpu", tokenizer=False).model
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [20, 21]]
    calls = []
    real = prof.Generator.generate
    monkeypatch.setattr(prof.Generator, "generate", lambda self, p, cfg: calls.append(len(p)) or real(self, p, cfg))
    base = Speculator(SpecConfig("draft", steps=3), draft_model=small)
    out = prof.measure_acceptance(target, None, base, prompts, max_new=12, batch=2, chain_steps=3, trees=[(3, 2, 8)])
    assert calls == [2, 1] * 2 * 3  # plain, chain, tree: two passes each, in batches of 2
    one = SpecMetrics()  # one pass of the chain, for comparison: the record counts one pass, not two
    for c in Generator(target, None, base).generate(prompts, GenerationConfig(max_new_tokens=12)):
        one.merge(c.spec)
    assert out["chain"]["drafts"] == one.drafts and out["chain"]["accept_length"] == one.accept_length
    assert out["plain"]["step_ms_measured"] > 0 and out["chain"]["step_ms_measured"] > 0
