"""Per-row sampling (sampling.RowSampling): every row of a batch has its own temperature, top-k,
top-p and counter-based random stream, so requests of any settings share a batch, each row's
speculative sampling is lossless against its own distribution, and a seeded row's text does not
depend on what runs beside it. One decoder serves every setting: changing settings allocates
nothing."""
import pytest
import torch

from eaglet.config import SpecConfig
from eaglet.generate import GenerationConfig, Generator
from eaglet.sampling import RowSampling, SamplingParams, target_probs
from eaglet.spec.speculator import Speculator

from .test_spec_greedy import random_head
from .test_spec_sampling import NEW, PROMPT, TRUNC, T1, V, exact_joint, models, tv, tv_bound  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

SETTINGS = [SamplingParams(), SamplingParams(0.7), SamplingParams(1.0, top_k=3), SamplingParams(0.9, top_p=0.8),
            SamplingParams(1.3, top_k=5, top_p=0.6)]


def rows_of(settings, keys=None) -> RowSampling:
    rs = RowSampling(len(settings), "cpu")
    rs.set(list(range(len(settings))), settings, keys or list(range(1, len(settings) + 1)))
    rs.choose_mode(range(len(settings)))
    return rs


def test_each_row_gets_the_distribution_of_its_settings():
    """RowSampling.scaled of a batch of mixed settings, softmaxed, equals target_probs row by row
    (greedy rows: their argmax is the logits'), over the node dimension of a verify too."""
    logits = torch.randn(len(SETTINGS), 3, 50, generator=torch.Generator().manual_seed(0)) * 3
    got = rows_of(SETTINGS).scaled(logits)
    for b, p in enumerate(SETTINGS):
        if p.greedy:
            assert torch.equal(got[b].argmax(-1), logits[b].argmax(-1))
        else:
            torch.testing.assert_close(got[b].softmax(-1), target_probs(logits[b], p), atol=1e-6, rtol=1e-5)
    greedy_only = rows_of([SamplingParams()] * 2)
    assert not greedy_only.mode.sampled and greedy_only.mode.key == "g"
    assert rows_of(SETTINGS[:2]).mode.key == "s" and rows_of(SETTINGS).mode.key == "f"


def test_a_rows_draws_do_not_depend_on_the_other_rows():
    """A row's draws are a function of its key, its position and its logits alone: the same in a
    batch of three as alone, different for another key."""
    logits = torch.randn(1, 3, 500, generator=torch.Generator().manual_seed(1))
    three = rows_of([SamplingParams(1.0), SamplingParams(0.5, top_k=9), SamplingParams(1.0)], keys=[11, 22, 33])
    alone = rows_of([SamplingParams(0.5, top_k=9)], keys=[22])
    offsets = torch.tensor([[1, 2, 2]])
    assert torch.equal(three.pick(logits.expand(3, -1, -1), offsets.expand(3, -1))[1], alone.pick(logits, offsets)[0])
    other = rows_of([SamplingParams(0.5, top_k=9)], keys=[23])
    many = [other.pick(logits, offsets + 3 * i) for i in range(8)] + [alone.pick(logits, offsets + 3 * i) for i in range(8)]
    assert len({tuple(m[0].tolist()) for m in many}) > 8


@pytest.fixture(scope="module")
def speculators(models):  # noqa: F811
    target, drafters = models
    return target, {"chain-draft": Speculator(SpecConfig("draft", steps=2), **drafters["draft"]),
                    "tree-eagle3": Speculator(SpecConfig("eagle3", steps=2, topk=3, draft_tokens=6),
                                              **drafters["eagle3"])}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["chain-draft", "tree-eagle3"])
def test_rows_of_different_settings_in_one_batch_are_each_lossless(speculators, name):
    """One batch, a third of its rows at temperature 1, a third with top-k and top-p, a third greedy:
    each group's empirical joint distribution of the first tokens after PROMPT passes the TV bound
    against its own exact distribution (test_spec_sampling's check), and every greedy row emits the
    greedy tokens."""
    target, sps = speculators
    greedy = Generator(target, None).generate([PROMPT], GenerationConfig(NEW, ignore_eos=True))[0].tokens
    per, calls = 12_000, 1
    groups = [T1, TRUNC, SamplingParams()]
    counts = [torch.zeros(V ** NEW) for _ in groups]
    gen = Generator(target, None, sps[name])
    for i in range(calls):
        settings = tuple(p for p in groups for _ in range(per))
        cfg = GenerationConfig(NEW, sampling=settings, ignore_eos=True)
        toks = torch.tensor([c.tokens for c in gen.generate([PROMPT] * len(settings), cfg)])
        code = toks @ V ** torch.arange(NEW - 1, -1, -1)
        for g, c in enumerate(counts):
            c += torch.bincount(code[g * per:(g + 1) * per], minlength=V ** NEW)
    for sp, c in zip(groups[:2], counts):
        exact = exact_joint(target, sp)
        assert tv(c / c.sum(), exact) < tv_bound(exact, int(c.sum())), sp
    want = greedy[0] * V ** 2 + greedy[1] * V + greedy[2]
    assert counts[2][want] == per * calls


@pytest.mark.parametrize("name", [None, "chain-draft", "tree-eagle3"])
def test_a_seeded_row_gives_the_same_tokens_whatever_runs_beside_it(speculators, name):
    """A seeded prompt in a batch with prompts of other settings (and other seeds) emits what it
    emits alone; an unseeded one does not repeat."""
    target, sps = speculators
    gen = Generator(target, None, sps[name] if name else None)
    seeded = SamplingParams(1.0, top_k=6, seed=42)
    cfg = lambda *ps: GenerationConfig(12, sampling=ps, ignore_eos=True)  # noqa: E731
    alone = gen.generate([PROMPT], cfg(seeded))[0].tokens
    others = [[3, 1], [2, 2, 7], [4]]
    mixed = gen.generate(others[:2] + [PROMPT] + others[2:],
                         cfg(SamplingParams(0.8), SamplingParams(), seeded, SamplingParams(1.2, seed=5)))
    assert mixed[2].tokens == alone
    unseeded = [gen.generate([PROMPT], cfg(SamplingParams(1.0)))[0].tokens for _ in range(4)]
    assert len({tuple(t) for t in unseeded}) > 1


def test_one_decoder_serves_every_setting(models, monkeypatch):  # noqa: F811
    """Calls that change temperature, top-p, top-k and seed from one to the next reuse the one
    decoder of the generator: no cache is allocated after the first (the server's Batcher takes the
    same decoder, so its memory stays flat whatever its requests ask)."""
    import eaglet.kvcache as kvcache

    target, drafters = models
    made = []
    init = kvcache.KVCache.__init__
    monkeypatch.setattr(kvcache.KVCache, "__init__", lambda self, *a, **k: made.append(a) or init(self, *a, **k))
    gen = Generator(target, None, Speculator(SpecConfig("eagle3", steps=2), head=random_head(target.config)))
    first = None
    for p in [SamplingParams(), SamplingParams(0.5), SamplingParams(0.3, top_p=0.9), SamplingParams(),
              SamplingParams(0.9, top_k=4, seed=1)]:
        gen.generate([PROMPT, [1, 2, 3]], GenerationConfig(8, sampling=p, ignore_eos=True))
        first = first or gen.decoder_in_use()
        assert gen.decoder_in_use() is first
    assert len(made) == 2  # the target's cache and the drafter's, once
