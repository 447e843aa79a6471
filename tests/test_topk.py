"""The row top-k kernel (spec/topk.py) on the CPU through Triton's interpreter (conftest sets
TRITON_INTERPRET=1 without a GPU): values and indices equal torch's log_softmax + topk on rows of a
draft vocabulary's width and on the narrow rows a tree's frontier picks from; ties go to the lower
index, as the stable sort select_tree needs; the fallback keeps torch's results; and a tree drafted
with the kernel is the tree drafted without it."""
import pytest
import torch

from eaglet import GenerationConfig, Generator, load_model
from eaglet.config import SpecConfig
from eaglet.kernels import EAGER, Kernels
from eaglet.models.llama import CausalLM
from eaglet.spec import topk as topk_mod
from eaglet.spec.topk import topk

from .test_spec_greedy import Recording, random_head, run_checked, small_draft  # noqa: F401 (a fixture)
from .triton_kernels import TOPK, triton_device

DEV = triton_device()


@pytest.mark.parametrize("shape,k", [((3, 16384), 8), ((1, 2, 4, 1000), 4), ((2, 64), 8), ((5, 37), 1),
                                     ((2, 457), 31), ((2, 5000), 4), ((1, 4099), 8)])
@pytest.mark.parametrize("log_softmax", [False, True])
def test_matches_torch(shape, k, log_softmax):
    g = torch.Generator().manual_seed(shape[-1] + k)
    x = (torch.randn(*shape, generator=g) * 3).to(DEV)  # float32: no ties
    assert topk_mod.usable(x, k)  # the kernel, not the fallback
    v, i = topk(x, k, log_softmax=log_softmax, kernel=True)
    y = x.float().log_softmax(-1) if log_softmax else x
    rv, ri = y.topk(k, -1)
    assert v.shape == i.shape == (*shape[:-1], k) and v.dtype == torch.float32 and i.dtype == torch.long
    assert torch.equal(i, ri)
    torch.testing.assert_close(v, rv, atol=1e-5, rtol=1e-5)


def test_offset_is_added_to_each_rows_values():
    """A tree level's children: each row's log-probabilities plus its node's score, from the kernel
    as from the fallback (the order of a row does not change)."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(2, 3, 1000, generator=g) * 3).to(DEV)
    score = -torch.rand(2, 3, generator=g).to(DEV) * 4
    v, i = topk(x, 4, log_softmax=True, offset=score, kernel=True)
    rv, ri = x.log_softmax(-1).topk(4, -1)
    assert torch.equal(i, ri)
    torch.testing.assert_close(v, rv + score[..., None], atol=1e-5, rtol=1e-5)
    fv, fi = topk(x, 4, log_softmax=True, offset=score)  # torch.topk
    assert torch.equal(fi, ri) and torch.equal(fv, rv + score[..., None])


def test_half_input_and_strided_rows():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3000, generator=g).half().to(DEV)[:, :2048]  # rows with a stride past their width
    assert topk_mod.usable(x, 6)
    v, i = topk(x, 6, log_softmax=True, kernel=True)
    ref = x.float().log_softmax(-1)
    # half values tie often: the indices hold the k largest, lowest index first among equals
    want = ref.sort(dim=-1, descending=True, stable=True)
    assert torch.equal(i, want.indices[:, :6])
    torch.testing.assert_close(v, want.values[:, :6], atol=1e-5, rtol=1e-5)


def test_ties_go_to_the_lower_index_as_a_stable_sort():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 5, (3, 300), generator=g).float().to(DEV)  # many equal values
    x[1] = float("-inf")  # a row of -inf but one entry: the picks after it are still distinct indices
    x[1, 7] = 0.0
    assert topk_mod.usable(x, 20)
    v, i = topk(x, 20, stable=True, kernel=True)
    want = x.sort(dim=-1, descending=True, stable=True)
    assert torch.equal(i, want.indices[:, :20]) and torch.equal(v, want.values[:, :20])
    assert all(len(set(r)) == 20 for r in i.tolist())


def test_wide_rows_cut_into_pieces_pick_as_one_row():
    """Rows of SPLIT_WIDTH or more go through pieces and a merge: ties across pieces still go to the
    lower index, a last piece narrower than k pads without taking a real entry's place, a piece of
    -inf adds nothing to the log-softmax, and the values and indices are the one-row kernel's."""
    g = torch.Generator().manual_seed(3)
    n = topk_mod.SPLIT_WIDTH + 3  # the last piece holds 3 entries, fewer than k
    x = torch.randint(0, 4, (4, n), generator=g).float()
    x[1, : topk_mod.CHUNK] = float("-inf")  # a whole piece of -inf
    x[2] = float("-inf")
    x[2, [5, n - 1]] = 1.0  # two entries in the row, the rest -inf: picks still distinct
    x[3, n - 2] = 9.0  # the best entry in the short last piece
    x = x.to(DEV)
    for log_softmax in (False, True):
        v, i = topk(x, 8, log_softmax=log_softmax, stable=True, kernel=True)
        y = x.float().log_softmax(-1) if log_softmax else x
        want = y.sort(dim=-1, descending=True, stable=True)
        assert torch.equal(i, want.indices[:, :8]), log_softmax
        torch.testing.assert_close(v, want.values[:, :8], atol=1e-5, rtol=1e-5)
        assert all(len(set(r)) == 8 for r in i.tolist())
        split = (v, i)
        width = topk_mod.SPLIT_WIDTH
        topk_mod.SPLIT_WIDTH = n + 1  # the same rows through the one-row kernel
        try:
            one = topk(x, 8, log_softmax=log_softmax, stable=True, kernel=True)
        finally:
            topk_mod.SPLIT_WIDTH = width
        assert torch.equal(split[1], one[1])
        torch.testing.assert_close(split[0], one[0], atol=1e-6, rtol=1e-6)


def test_fallback_when_off():
    x = torch.randn(2, 50, generator=torch.Generator().manual_seed(2))
    v, i = topk(x, 4, log_softmax=True)  # kernel=False: a model whose Kernels.topk is off
    rv, ri = x.log_softmax(-1).topk(4, -1)
    assert torch.equal(i, ri) and torch.equal(v, rv)
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0]])
    assert topk(x, 3, stable=True)[1].tolist() == [[1, 2, 4]]


@pytest.mark.parametrize("spec", [SpecConfig("eagle3", steps=3, topk=3, draft_tokens=8),
                                  SpecConfig("draft", steps=3, topk=2, draft_tokens=9)])
def test_tree_with_the_kernel_is_the_tree_without(tiny_dirs, small_draft, spec):
    """The drafters' tree expansion and select_tree through the kernel: the same proposals, step by
    step, as through torch (float32 logits of random models do not tie), and plain greedy output."""
    model = load_model(tiny_dirs["llama3"][0], dtype="float32", device="cpu", tokenizer=False).model
    prompts = [[5, 9, 17, 3], list(range(20, 31))]
    gen = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    ref = [Generator(model, None).generate([p], gen)[0].tokens for p in prompts]
    steps = {}
    for kernels in (EAGER, TOPK):
        sp = (Recording(spec, head=random_head(model.config, kernels=kernels)) if spec.method == "eagle3"
              else Recording(spec, draft_model=with_kernels(small_draft, kernels)))
        run_checked(model, prompts, ref, sp, gen)
        steps[kernels] = sp.rec.steps
    assert steps[TOPK] == steps[EAGER] and len(steps[TOPK]) > 5


def with_kernels(model: CausalLM, kernels: Kernels) -> CausalLM:
    """The same weights as `model`, running `kernels`."""
    other = CausalLM(model.config, kernels)
    other.load_state_dict(model.state_dict())
    other.fuse_projections()
    return other.eval().requires_grad_(False)


def test_argmax_through_the_split_kernels_is_torchs():
    """sampling.argmax: rows of SPLIT_WIDTH or more take the split top-k kernels with k = 1 where
    the model's kernels take top-k; the picks are torch.argmax's, the lowest index among equal
    maxima included (within a piece and across pieces), in bfloat16 as the target's logits come,
    and for (B, N, V) verify logits; narrower rows and EAGER keep torch.argmax."""
    from eaglet.sampling import argmax

    g = torch.Generator().manual_seed(5)
    n = 2 * topk_mod.SPLIT_WIDTH + 17
    x = torch.randint(0, 6, (5, n), generator=g).float()  # many equal maxima
    x[1, 3000] = x[1, 5000] = 7.0  # the maximum twice, in two pieces
    x[2] = float("-inf")
    x[2, n - 1] = 0.0  # the only finite entry, in the short last piece
    x[3, topk_mod.CHUNK:] = 9.0  # equal maxima from a piece boundary on
    kernels = Kernels(topk=True)
    for y in (x, x.bfloat16(), x.view(5, 1, n).expand(5, 3, n).bfloat16()):
        y = y.to(DEV)
        assert topk_mod.usable(y, 1)
        got = argmax(y, kernels)
        assert got.shape == y.shape[:-1] and got.dtype == torch.long
        assert torch.equal(got.cpu(), y.cpu().float().argmax(-1))
    assert argmax(x[:, :100].to(DEV), kernels).tolist() == x[:, :100].argmax(-1).tolist()  # narrow: torch's
    calls = []
    real = topk_mod.topk
    topk_mod.topk = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        argmax(x.to(DEV), EAGER)  # the kernels off: torch.argmax
        argmax(x[:, :100].to(DEV), kernels)
        assert not calls
        argmax(x.to(DEV), kernels)
        assert calls
    finally:
        topk_mod.topk = real
