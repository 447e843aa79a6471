"""Speculative sampling is lossless: with any drafter (draft model, EAGLE-3 head; chain or tree) the
tokens it emits are distributed exactly as the target's own sampling. Checked end to end on a target
with an 8-token vocabulary: the empirical joint distribution of the first tokens after a fixed prompt
(100k samples) against the exact one, enumerated with the target; deliberately wrong rules must fail
the same check. And stronger: with the same seed a speculating generator emits exactly what plain
sampling emits. Also: seeded runs repeat, and verify on hand-made tensors."""
import itertools
import math
from dataclasses import replace

import pytest
import torch

import eaglet.spec.loop
from eaglet.config import SpecConfig
from eaglet.generate import GenerationConfig, Generator
from eaglet.kvcache import KVCache
from eaglet.models.attention import AttnMeta
from eaglet.sampling import RowSampling, SamplingParams, target_probs
from eaglet.spec.drafters.eagle3_head import Eagle3Config, Eagle3Head
from eaglet.spec.speculator import Speculator
from eaglet.spec.tree import DraftProposal
from eaglet.spec.verify import VerifyResult, emitted_path, greedy_verify
from eaglet.weights import load_model

from .conftest import hf_model

V, PROMPT, NEW = 8, [1, 5], 3  # vocabulary, fixed prompt, tokens sampled after it: K = 8**3 outcomes
CALLS, BATCH = 5, 20_000  # 100k samples per case, 20k identical prompts per generate call
DELTA = 1e-6  # chance that a correct engine fails the bound (see tv_bound)
T1 = SamplingParams(temperature=1.0)
TRUNC = SamplingParams(temperature=0.8, top_k=5, top_p=0.9)
# With NEW = 3 the first token comes from the prefill and the next two from speculation: with two
# draft steps the second draft's acceptance decides the third token (the bonus after it is cut by
# the token limit); with one step the bonus after a fully accepted chain is emitted too.
CASES = {
    "chain-draft": (SpecConfig("draft", steps=2), T1),
    "chain-draft-1step-topk-topp": (SpecConfig("draft", steps=1), TRUNC),
    "chain-eagle3": (SpecConfig("eagle3", steps=2), T1),
    "tree-draft-topk-topp": (SpecConfig("draft", steps=2, topk=3, draft_tokens=6), TRUNC),
    "tree-eagle3": (SpecConfig("eagle3", steps=2, topk=3, draft_tokens=6), T1),
}


pytestmark = pytest.mark.usefixtures("one_thread")  # small matmuls: one thread is as fast


def tiny(path, seed: int, layers: int):
    m = hf_model("llama3", seed, vocab_size=V, hidden_size=16, intermediate_size=16, num_hidden_layers=layers,
                 num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=32)
    with torch.no_grad():
        m.lm_head.weight.mul_(4)  # peaked distributions, so that a wrong rule moves visible mass
    m.save_pretrained(path, safe_serialization=True)
    return load_model(path, dtype="float32", device="cpu", tokenizer=False).model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(target, drafter kwargs for Speculator by method): a different random model as the draft
    model (so q != p), and a random EAGLE-3 head (taps layers 2, 1, 0 of the 3-layer target)."""
    target = tiny(tmp_path_factory.mktemp("target"), 0, 3)
    draft = tiny(tmp_path_factory.mktemp("draft"), 1, 1)
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.for_target(target.config)).eval()
    return target, {"draft": dict(draft_model=draft), "eagle3": dict(head=head)}


@torch.inference_mode()
def exact_joint(model, sp: SamplingParams) -> torch.Tensor:
    """P(x1..xn | PROMPT) = prod_i p(x_i | PROMPT, x_<i), for every outcome (a base-V number):
    one forward over all V**(n-1) continuations, whose rows are the outcomes' first n-1 digits."""
    seqs = torch.tensor([PROMPT + list(c) for c in itertools.product(range(V), repeat=NEW - 1)])
    b, t = seqs.shape
    cache = KVCache.for_model(model.config, b, t, torch.float32, "cpu")
    pos = torch.arange(t).expand(b, t)
    hidden, _ = model(seqs, pos, cache, AttnMeta.build(cache.lens, pos, t))
    p = target_probs(model.logits(hidden[:, len(PROMPT) - 1:]), sp)  # (V**(n-1), n, V)
    code = torch.arange(V ** NEW)
    joint = torch.ones(V ** NEW)
    for i in range(NEW):
        joint *= p[code // V, i, code // V ** (NEW - 1 - i) % V]
    return joint


def sample_joint(target, speculator, sp: SamplingParams, calls: int = CALLS) -> tuple[torch.Tensor, int]:
    """(the empirical joint distribution of the NEW tokens, the sample count)."""
    gen = Generator(target, None, speculator)
    counts = torch.zeros(V ** NEW)
    for i in range(calls):
        cfg = GenerationConfig(max_new_tokens=NEW, sampling=replace(sp, seed=1000 + i), ignore_eos=True)
        toks = torch.tensor([c.tokens for c in gen.generate([PROMPT] * BATCH, cfg)])
        counts += torch.bincount(toks @ V ** torch.arange(NEW - 1, -1, -1), minlength=V ** NEW)
    return counts / counts.sum(), calls * BATCH


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * (a - b).abs().sum().item()


def tv_bound(p: torch.Tensor, n: int) -> float:
    """For n independent samples from p, the empirical p^ has
        E[TV] = 1/2 sum_i E|p^_i - p_i| <= 1/2 sum_i sqrt(p_i (1 - p_i) / n)   (Jensen: E|X| <= sqrt(E X^2))
                                        <= 1/2 sqrt(K / n)                     (Cauchy-Schwarz, K outcomes),
    and one sample moves TV by at most 1/n, so by McDiarmid P(TV >= E[TV] + t) <= exp(-2 n t^2); with
    t = sqrt(ln(1/DELTA) / (2n)) a correct engine fails with probability < DELTA. For K = 512 and
    n = 100k that is at most 0.036 + 0.008 (0.017-0.025 here: p is peaked). The safety factor is the
    slack of the two inequalities (E[TV] is ~0.8 of the first bound). Seeds are fixed: repeatable."""
    return 0.5 * (p * (1 - p) / n).sqrt().sum().item() + math.sqrt(math.log(1 / DELTA) / (2 * n))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_speculative_sampling_is_lossless(models, monkeypatch, name):
    target, drafters = models
    spec, sp = CASES[name]
    counts = torch.zeros(spec.steps + 2)  # verify results by accepted nodes (root included), before the limit

    def spy(*args, **kw):
        res = greedy_verify(*args, **kw)
        counts.add_(torch.bincount(res.count, minlength=spec.steps + 2))
        return res
    monkeypatch.setattr(eaglet.spec.loop, "greedy_verify", spy)
    exact = exact_joint(target, sp)
    got, n = sample_joint(target, Speculator(spec, **drafters[spec.method]), sp)
    assert tv(got, exact) < tv_bound(exact, n)
    # and speculation was exercised: rejections at the first draft, acceptances at every depth
    # (the random EAGLE-3 head's trees reach depth 2 in ~0.7% of the steps, ~1000 times here)
    share = counts / counts.sum()
    assert share[1] > 0.05 and (share[2:] > 0.003).all(), share.tolist()


@pytest.mark.slow
def test_speculative_sampling_is_lossless_on_an_moe_target(tmp_path):
    """The same check with a Mixture-of-Experts target (top-2 of 4 routed experts a layer) and a
    draft model as a tree, top-k and top-p on: its tokens are distributed as its own sampling's."""
    m = hf_model("qwen3_moe", 0, vocab_size=V, hidden_size=16, intermediate_size=16, num_hidden_layers=2,
                 num_attention_heads=1, num_key_value_heads=1, head_dim=16, max_position_embeddings=32,
                 num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, mlp_only_layers=[])
    with torch.no_grad():
        m.lm_head.weight.mul_(4)
    m.save_pretrained(tmp_path / "moe", safe_serialization=True)
    target = load_model(tmp_path / "moe", dtype="float32", device="cpu", tokenizer=False).model
    draft = tiny(tmp_path / "draft", 1, 1)
    spec, sp = CASES["tree-draft-topk-topp"]
    exact = exact_joint(target, sp)
    got, n = sample_joint(target, Speculator(spec, draft_model=draft), sp, calls=2)
    assert tv(got, exact) < tv_bound(exact, n)


# ---- deliberately wrong rules, which the same check must catch -----------------------------------

def always_accept(prop, target, max_depth, kernels=None):
    """Wrong: take the first child at every depth whatever the target drew, then its token there."""
    b = prop.tokens.shape[0]
    node, path = torch.zeros(b, dtype=torch.long), [torch.zeros(b, dtype=torch.long)]
    for _ in range(max_depth):
        node = ((prop.parents == node[:, None]) & prop.valid).to(torch.uint8).argmax(1)
        path.append(node)
    path = torch.stack(path, 1)
    return VerifyResult(*emitted_path(prop.tokens, path, torch.full((b,), max_depth + 1),
                                      target.gather(1, path[:, -1:])[:, 0]))


_seeds = RowSampling.seeds


def same_noise_everywhere(self, offset, kernels=None):
    """Wrong: noise keyed by the row's stream alone, the same at every position."""
    return _seeds(self, 0 * offset - self.base.view(-1, *([1] * (offset.dim() - 1))) if torch.is_tensor(offset)
                  else -self.base, kernels)


@pytest.mark.parametrize("rule,name", [("accept", "tree-eagle3"), ("noise", "tree-eagle3"), ("noise", "chain-draft")])
def test_wrong_rule_fails_the_check(models, monkeypatch, rule, name):
    """A fifth of the samples already puts the wrong rule's TV far above its (larger) bound."""
    target, drafters = models
    spec, sp = CASES[name]
    if rule == "accept":
        monkeypatch.setattr(eaglet.spec.loop, "greedy_verify", always_accept)
    else:
        monkeypatch.setattr(RowSampling, "seeds", same_noise_everywhere)
    exact = exact_joint(target, sp)
    got, n = sample_joint(target, Speculator(spec, **drafters[spec.method]), sp, calls=1)
    assert tv(got, exact) > 2 * tv_bound(exact, n)


@pytest.mark.parametrize("name", list(CASES))
def test_speculation_emits_what_plain_sampling_emits(models, name):
    """The same seeds, speculating or not: the same tokens, row for row (the target draws each
    position with the same noise; the drafter only changes how many a step takes)."""
    target, drafters = models
    spec, sp = CASES[name]
    cfg = GenerationConfig(max_new_tokens=10, sampling=replace(sp, seed=11), ignore_eos=True)
    prompts = [PROMPT, [3, 1, 4], [2], [6, 6, 0, 2]] * 8
    plain = [c.tokens for c in Generator(target, None).generate(prompts, cfg)]
    spec_out = Generator(target, None, Speculator(spec, **drafters[spec.method])).generate(prompts, cfg)
    assert [c.tokens for c in spec_out] == plain
    assert len({tuple(t) for t in plain}) > 8  # rows drew apart
    assert sum(c.spec.accepted_tokens for c in spec_out) > 0  # and drafts were taken


def test_a_tree_ranks_sampled_children_with_the_targets_noise(models, sp=T1):
    """A draft tree whose drafter is the target itself: its best child at each level is the
    target's own draw there (the same noise), so every draft is accepted whole (the tree keeps all
    its 6 candidates). Ranked by the drafter's probabilities alone, a draw outside the top 2 of 8
    would be rejected."""
    target, _ = models
    gen = Generator(target, None, Speculator(SpecConfig("draft", steps=2, topk=2, draft_tokens=7), draft_model=target))
    cfg = GenerationConfig(max_new_tokens=13, sampling=replace(sp, seed=5), ignore_eos=True)
    out = gen.generate([PROMPT, [3, 1, 4], [2], [6, 6, 0, 2]] * 4, cfg)
    assert len({tuple(c.tokens) for c in out}) > 4  # rows drew apart
    for c in out:  # the first token from the prefill, then 4 steps of 2 drafts and the bonus
        assert c.spec.drafts == 4 and c.spec.accepted_tokens == 8, c.spec


def test_seeded_speculation_repeats(models):
    target, drafters = models
    for name in ("chain-draft", "tree-eagle3"):
        spec, sp = CASES[name]
        gen = Generator(target, None, Speculator(spec, **drafters[spec.method]))

        def run(seed):
            cfg = GenerationConfig(max_new_tokens=12, sampling=replace(sp, seed=seed), ignore_eos=True)
            return [c.tokens for c in gen.generate([PROMPT] * 16, cfg)]
        first = run(7)
        assert run(7) == first, name
        assert run(8) != first, name
        assert len(set(map(tuple, first))) > 1, name  # rows draw independently


# ---- verify on hand-made tensors -------------------------------------------------------------------

PARENTS = [-1, 0, 0, 1, 2, 2]  # root; 1, 2 under it; 3 under 1; 4, 5 under 2
TOKENS = [9, 3, 4, 5, 6, 7]


def hand_tree(rows: int, valid=None) -> DraftProposal:
    return DraftProposal.from_parents(torch.tensor([TOKENS] * rows), torch.tensor([PARENTS] * rows), valid)


def test_greedy_verify_hand_tree():
    valid = torch.ones(3, 6, dtype=torch.bool)
    valid[2, 2] = False  # row 2: the matching child is padding
    argmax = torch.tensor([[4, 0, 7, 0, 0, 1],  # root -> 2 (token 4) -> 5 (token 7), bonus 1
                           [3, 2, 0, 0, 0, 0],  # root -> 1 (token 3); node 1 has no child 2: bonus 2
                           [4, 0, 7, 0, 0, 1]])  # node 2 invalid: nothing accepted, bonus 4
    res = greedy_verify(hand_tree(3, valid), argmax, max_depth=2)
    assert res.count.tolist() == [3, 2, 1]
    assert res.path.tolist() == [[0, 2, 5], [0, 1, 0], [0, 0, 0]]
    assert [res.tokens[b, :c].tolist() for b, c in enumerate(res.count)] == [[4, 7, 1], [3, 2], [4]]
    assert res.bonus.tolist() == [1, 2, 4]
