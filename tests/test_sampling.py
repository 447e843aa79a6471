"""Sampling: parameter validation, the target distribution (temperature, top-k, top-p) and each
row's draws (RowSampling.pick: Gumbel-max with counter-based noise), which must follow exactly that
distribution."""
import math

import pytest
import torch

from eaglet.errors import InvalidInput
from eaglet.sampling import RowSampling, SamplingParams, target_probs

# probabilities that are exact in float32, so top-p boundaries are exact too
EXACT = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625])


def rand_logits(*shape: int, seed: int = 0) -> torch.Tensor:
    return 3 * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def shuffled_exact() -> tuple[torch.Tensor, torch.Tensor]:
    """Logits whose softmax is EXACT, in a shuffled vocab order; and that order."""
    order = torch.tensor([3, 0, 4, 1, 2])  # token order[i] has probability EXACT[i]
    logits = torch.empty(5)
    logits[order] = EXACT.log()
    return logits, order


# ---- validation ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [
    dict(temperature=-1.0), dict(temperature=-1e-6), dict(temperature=float("nan")),
    dict(top_p=0.0), dict(top_p=-0.5), dict(top_p=1.5), dict(top_p=float("nan")),
    dict(top_k=-1), dict(top_k=2.5),
])
def test_invalid_params_raise(kw):
    with pytest.raises(InvalidInput):
        SamplingParams(**kw)


def test_boundary_params_are_valid():
    p = SamplingParams(temperature=0, top_p=1.0, top_k=0)
    assert p.greedy
    assert not SamplingParams(temperature=1e-3, top_p=1e-3, top_k=1).greedy


# ---- target_probs -------------------------------------------------------------------------------

def test_greedy_is_one_hot_of_argmax():
    logits = rand_logits(2, 3, 50)
    probs = target_probs(logits, SamplingParams())
    assert probs.dtype == torch.float32 and probs.shape == logits.shape
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 50).float())


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_temperature_is_scaled_softmax(temperature):
    logits = rand_logits(4, 50)
    probs = target_probs(logits, SamplingParams(temperature=temperature))
    assert torch.allclose(probs, (logits / temperature).softmax(-1), atol=1e-6)


@pytest.mark.parametrize("k", [1, 3, 10])
def test_top_k_keeps_exactly_k(k):
    logits = rand_logits(4, 50, seed=1)  # distinct values: no ties at the k-th
    probs = target_probs(logits, SamplingParams(temperature=0.8, top_k=k))
    top = logits.topk(k, -1).indices
    assert ((probs > 0).sum(-1) == k).all()
    assert torch.equal(probs.gather(-1, top) > 0, torch.ones(4, k, dtype=torch.bool))
    want = (logits.gather(-1, top) / 0.8).softmax(-1)  # renormalised over the kept tokens
    assert torch.allclose(probs.gather(-1, top), want, atol=1e-6)


def test_top_k_at_least_vocab_is_off():
    logits = rand_logits(3, 20)
    p = target_probs(logits, SamplingParams(temperature=1.0, top_k=20))
    assert torch.allclose(p, logits.softmax(-1), atol=1e-6)


@pytest.mark.parametrize("top_p, n_kept", [(0.3, 1), (0.5, 1), (0.6, 2), (0.75, 2), (0.8, 3),
                                           (0.875, 3), (0.9, 5), (1.0, 5)])
def test_top_p_keeps_smallest_prefix_reaching_p(top_p, n_kept):
    """Sorted probs .5 .25 .125 .0625 .0625: mass of the first n is .5 .75 .875 .9375 1, so e.g.
    top_p=.75 keeps exactly two tokens (the pair already reaches .75). The last two are equal: at
    .9 the fourth is kept and so is its equal (the mass above both is .875), whichever a sort put first."""
    logits, order = shuffled_exact()
    probs = target_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
    want = torch.zeros(5)
    want[order[:n_kept]] = EXACT[:n_kept] / EXACT[:n_kept].sum()
    assert torch.allclose(probs, want, atol=1e-6)


def test_top_k_then_top_p():
    logits, order = shuffled_exact()
    # top-k=3 renormalises to .571 .286 .143; top-p=.8 then needs the first two (.857)
    probs = target_probs(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.8))
    want = torch.zeros(5)
    want[order[:2]] = torch.tensor([2 / 3, 1 / 3])
    assert torch.allclose(probs, want, atol=1e-6)


# ---- sampling ----------------------------------------------------------------------------------

N_DRAWS = 200_000


def rows(p: SamplingParams, n: int) -> RowSampling:
    """n rows of one setting, each with the stream the i-th prompt of a call gets."""
    rs = RowSampling(n, "cpu")
    rs.set(list(range(n)), [p] * n, [p.stream(i) for i in range(n)])
    rs.choose_mode(range(n))
    return rs


def draw_counts(logits: torch.Tensor, p: SamplingParams, position: int = 0) -> torch.Tensor:
    """The tokens N_DRAWS rows (each its own stream) draw from the same logits."""
    toks = rows(p, N_DRAWS).pick(logits.expand(N_DRAWS, -1), position)
    return torch.bincount(toks, minlength=logits.shape[-1]).double()


@pytest.mark.parametrize("p", [SamplingParams(1.0, seed=0), SamplingParams(0.6, seed=1),
                               SamplingParams(1.0, top_k=3, top_p=0.9, seed=2)])
def test_draws_match_the_distribution(p):
    logits = torch.tensor([0.3, -1.0, 1.2, 0.0, 0.8])
    probs = target_probs(logits, p).double()
    counts = draw_counts(logits, p)
    live = probs > 0
    expected = N_DRAWS * probs[live]
    chi2 = float(((counts[live] - expected) ** 2 / expected).sum())
    assert chi2 < 18.47  # chi-square, at most 4 degrees of freedom, p = 0.001
    assert counts[~live].sum() == 0  # what top-k and top-p cut is never drawn
    assert 0.5 * float((counts / N_DRAWS - probs).abs().sum()) < 0.005


def test_draws_never_take_a_zero_probability_token():
    logits, order = shuffled_exact()
    counts = draw_counts(logits, SamplingParams(1.0, top_p=0.75, seed=3))  # keeps EXACT's first two
    assert counts[order[2:]].sum() == 0
    assert math.isclose(counts[order[0]] / N_DRAWS, 2 / 3, abs_tol=0.005)


def test_seeded_sampling_is_repeatable():
    logits = rand_logits(64, 100)
    a, b, c = (rows(SamplingParams(1.0, seed=s), 64).pick(logits, 0) for s in (7, 7, 8))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert SamplingParams(1.0).stream() != SamplingParams(1.0).stream()  # unseeded: a fresh stream each time


def test_a_draw_is_keyed_by_the_stream_and_the_position_alone():
    """The same row draws alike in a batch of three and alone, and afresh at every position: the
    noise is a function of (key, position, token) only."""
    logits = rand_logits(1, 1000, seed=4) * 0  # uniform: the draw is the noise's argmax
    three, alone = RowSampling(3, "cpu"), RowSampling(1, "cpu")
    three.set([0, 1, 2], [SamplingParams(1.0)] * 3, [11, 22, 33])
    alone.set([0], [SamplingParams(1.0)], [22])
    for rs in (three, alone):
        rs.choose_mode([0])
    three.base[:], alone.base[:] = 5, 5
    assert three.pick(logits.expand(3, -1), 2)[1] == alone.pick(logits, 2)[0]
    at = [int(alone.pick(logits, t)[0]) for t in range(20)]
    assert len(set(at)) > 15  # a fresh draw at each position (1000 equally likely tokens)
    alone.base[:] = 7
    assert int(alone.pick(logits, 0)[0]) == at[2]  # position 7 whether reached as 5 + 2 or 7 + 0
    nodes = alone.pick(logits.expand(1, 4, -1), torch.tensor([[0, 1, 1, 2]]))  # a verify's (B, N) positions
    assert nodes[0].tolist() == [at[2], at[3], at[3], at[4]]


def test_pick_greedy_and_masked():
    logits = rand_logits(8, 100, seed=2)
    assert torch.equal(rows(SamplingParams(), 8).pick(logits, 0), logits.argmax(-1))
    top2 = logits.topk(2, -1).indices
    rs = rows(SamplingParams(temperature=5.0, top_k=2), 8)
    for t in range(20):  # with top_k=2 every draw is one of the two best tokens
        tok = rs.pick(logits, t)
        assert ((top2 == tok[:, None]).any(-1)).all()


def unmix32(h: int) -> int:
    """The x with sampling.mix32(x) == h (each step of the hash is invertible on 32 bits)."""
    inv = pow(0x45D9F3B, -1, 1 << 32)
    x = h ^ (h >> 16)
    x = (x * inv) & 0xFFFFFFFF
    x ^= x >> 16
    x = (x * inv) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_the_largest_hash_gives_finite_noise():
    """A token whose hash is all ones (one in 2**24 tokens a draw: 0.3% of draws over 49,152) gets
    finite noise, so it wins only by its logit and noise, and never when its logit is -inf (cut)."""
    from eaglet.sampling import gumbel_argmax, gumbel_noised, mix32

    seed = torch.tensor([12345])
    hot = unmix32(0xFFFFFFFF) ^ 12345
    assert int(mix32(torch.tensor(hot ^ 12345))) == 0xFFFFFFFF
    ids = torch.tensor([7, hot])
    assert gumbel_noised(torch.zeros(1, 2), seed, ids).isfinite().all()
    assert int(gumbel_argmax(torch.tensor([[0.0, float("-inf")]]), seed, ids)) == 0
