"""The sampled draw under top-k / top-p without a sort (eaglet/cut_draw.py, float32 and bfloat16
logits): the kernel draws what the torch path (a sort of the vocabulary, sampling.RowSampling.scaled) draws, token for token, for any
mix of settings; equal logits are kept or cut together on both paths; the kernel's draws follow the
target distribution; a row's draw does not depend on the other rows."""
import pytest
import torch

from eaglet import cut_draw
from eaglet.kernels import Kernels
from eaglet.sampling import RowSampling, SamplingParams, gumbel_argmax, target_probs

from .triton_kernels import triton_device

DEV = triton_device()
DRAW = Kernels(draw=True)
SETTINGS = [SamplingParams(0.8, top_p=0.9), SamplingParams(1.0, top_k=20), SamplingParams(0.7, top_k=50, top_p=0.8),
            SamplingParams(), SamplingParams(1.3, top_p=0.5), SamplingParams(1.0, top_k=5, top_p=0.3),
            SamplingParams(0.9, top_k=1), SamplingParams(1.0, top_k=5000, top_p=0.95), SamplingParams(1.0)]


@pytest.fixture(autouse=True, params=[False, True], ids=["one program a row", "over slices"])
def every_row_count(monkeypatch, request):
    """The kernels for calls of any size (in the package: from cut_draw.MIN_ROWS rows), one program
    a row and over slices (at every row count)."""
    monkeypatch.setattr(cut_draw, "MIN_ROWS", 1)
    monkeypatch.setattr(cut_draw, "SPLIT", request.param)
    monkeypatch.setattr(cut_draw, "SPLIT_ROWS", 1 << 30)


def rows_of(settings, keys=None) -> RowSampling:
    rs = RowSampling(len(settings), DEV)
    rs.set(list(range(len(settings))), settings, keys or [100 + i for i in range(len(settings))])
    rs.choose_mode(range(len(settings)))
    return rs


@pytest.mark.parametrize("nodes", [0, 3])
def test_the_kernel_draws_what_the_sorted_cut_draws(nodes):
    """bfloat16 logits (many equal values) over 3,000 entries (two of the kernel's chunks), a plain
    step's (B, V) and a verify's (B, N, V) with per-node positions: the same tokens on both paths,
    greedy rows their argmax; and the cut matters (the uncut draw differs for most cut rows)."""
    gen = torch.Generator().manual_seed(nodes)
    rs = rows_of(SETTINGS)
    b, v = len(SETTINGS), 3000
    shape = (b, v) if nodes == 0 else (b, nodes, v)
    cut_rows = torch.tensor([p.filters for p in SETTINGS])
    differs = 0
    for trial in range(4):
        logits = (torch.randn(shape, generator=gen) * 3).to(torch.bfloat16).to(DEV)
        offset = trial if nodes == 0 else torch.arange(b * nodes).view(b, nodes).to(DEV) % 5 + trial
        want = rs.pick(logits, offset)
        got = rs.pick(logits, offset, DRAW)
        assert torch.equal(got, want), (trial, got, want)
        uncut = gumbel_argmax(logits.float() / rs.temperature.clamp(min=1e-6).view(-1, *[1] * (logits.dim() - 1)),
                              rs.seeds(offset), rs.vocab_ids(v))
        differs += int((uncut != got)[cut_rows].sum())
    assert differs >= 4  # the cut changed some draws
    if nodes == 0:  # top-k 1: the argmax of the row
        assert int(got[6]) == int(logits[6].float().argmax())


def test_a_drafters_own_vocabulary_draws_with_the_targets_noise():
    """Logits over a drafter's vocabulary (ids mapped to the target's): the kernel hashes the mapped
    ids, as the torch path does."""
    rs = rows_of(SETTINGS[:3])
    vocab = torch.randperm(5000, generator=torch.Generator().manual_seed(2))[:700].to(DEV)
    logits = torch.randn(3, 2, 700, generator=torch.Generator().manual_seed(3)).to(DEV)
    offset = torch.tensor([[1, 2]] * 3, device=DEV)
    assert torch.equal(rs.pick(logits, offset, DRAW, vocab), rs.pick(logits, offset, None, vocab))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equal_logits_are_kept_or_cut_together(dtype):
    """A nucleus whose edge falls inside a run of equal logits keeps the whole run, on both paths
    (a sort would keep those it happened to put first)."""
    logits = torch.tensor([4.0, 2.0, 2.0, 2.0, 2.0, -5.0, -5.0], dtype=dtype).float()
    probs = logits.softmax(-1)
    p = SamplingParams(1.0, top_p=float(probs[0] + probs[1] / 2), seed=0)  # the edge at the first 2.0
    want = target_probs(logits, p)
    assert (want[:5] > 0).all() and (want[5:] == 0).all() and torch.allclose(want[1:5], want[1].expand(4))
    n = 400
    rs = RowSampling(n, DEV)
    rs.set(list(range(n)), [p] * n, [p.stream(i) for i in range(n)])
    rs.choose_mode(range(n))
    x = logits.to(dtype).to(DEV).expand(n, -1)
    assert torch.equal(rs.scaled(x)[0].isfinite().cpu(), want > 0)
    drawn = rs.pick(x, 0, DRAW).cpu()
    assert set(drawn.tolist()) == {0, 1, 2, 3, 4}
    assert torch.equal(drawn, rs.pick(x, 0).cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_draws_follow_the_distribution(dtype):
    """400 rows, each its own stream, drawing from one set of logits through the kernel: total
    variation from target_probs under 0.1 (about four standard deviations), and nothing the cut
    removes is drawn. (The torch path, which the kernel matches draw for draw, has its 200,000-draw
    test in test_sampling.py.)"""
    logits = torch.tensor([0.3, -1.0, 1.2, 0.0, 0.8, -0.4], dtype=dtype).float()
    p = SamplingParams(1.0, top_k=4, top_p=0.8, seed=5)
    n = 400
    rs = RowSampling(n, DEV)
    rs.set(list(range(n)), [p] * n, [p.stream(i) for i in range(n)])
    rs.choose_mode(range(n))
    counts = torch.bincount(rs.pick(logits.to(dtype).to(DEV).expand(n, -1), 0, DRAW).cpu(), minlength=6).double()
    probs = target_probs(logits, p).double()
    assert counts[probs == 0].sum() == 0 and (probs == 0).sum() == 3  # top-k 4, then top-p drops one
    assert 0.5 * float((counts / n - probs).abs().sum()) < 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_draw_is_the_same_alone_and_in_a_batch(dtype):
    logits = (torch.randn(len(SETTINGS), 1000, generator=torch.Generator().manual_seed(4)) * 2).to(dtype).to(DEV)
    batch = rows_of(SETTINGS).pick(logits, 7, DRAW)
    for i in (0, 2, 5):
        alone = rows_of([SETTINGS[i]], keys=[100 + i]).pick(logits[i:i + 1], 7, DRAW)
        assert int(alone) == int(batch[i])


def test_calls_of_few_rows_keep_the_sort(monkeypatch):
    """Below MIN_ROWS rows the sort runs (measured faster there for top-k); from it, the kernel."""
    monkeypatch.setattr(cut_draw, "MIN_ROWS", 16)
    calls = []
    real = cut_draw.cut_draw
    monkeypatch.setattr(cut_draw, "cut_draw", lambda *a: calls.append(a[0].shape) or real(*a))
    rs = rows_of(SETTINGS[:2])
    nodes = lambda n: torch.arange(n, device=DEV).expand(2, -1)  # noqa: E731
    rs.pick(torch.randn(2, 7, 300, device=DEV), nodes(7), DRAW)
    assert calls == []
    rs.pick(torch.randn(2, 8, 300, device=DEV), nodes(8), DRAW)
    assert calls == [(2, 8, 300)]


def test_calls_of_many_rows_take_one_program_a_row(monkeypatch):
    """Over slices up to SPLIT_ROWS rows (positions), one program a row above: the same draws."""
    monkeypatch.setattr(cut_draw, "SPLIT", True)
    monkeypatch.setattr(cut_draw, "SPLIT_ROWS", 2)
    launched = []

    class Seen:  # a kernel that notes its launches
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            launched.append(self.name)
            return self.kernel[grid]

    for name in ("cut_draw_kernel", "finish_kernel"):
        monkeypatch.setattr(cut_draw, name, Seen(name, getattr(cut_draw, name)))
    logits = (torch.randn(4, 2, 3000, generator=torch.Generator().manual_seed(5)) * 3).to(DEV)
    rs = rows_of(SETTINGS[:4])
    offsets = torch.arange(8, device=DEV).view(4, 2)
    for rows, path in ((1, "finish_kernel"), (2, "cut_draw_kernel")):  # 2 and 4 positions
        launched.clear()
        got = rs.rows(rows).pick(logits[:rows], offsets[:rows], DRAW)
        assert launched == [path]
        assert torch.equal(got, rs.rows(rows).pick(logits[:rows], offsets[:rows]))


def test_a_prefills_first_tokens_are_drawn_by_the_kernels(monkeypatch):
    """A prefill's first tokens (runtime.plain.first_tokens, the general path for any row) go
    through cut_draw where the model's kernels draw, and equal the sort's."""
    from types import SimpleNamespace

    from eaglet.runtime.plain import first_tokens

    calls = []
    real = cut_draw.cut_draw
    monkeypatch.setattr(cut_draw, "cut_draw", lambda *a: calls.append(a[0].shape) or real(*a))
    rs = rows_of(SETTINGS)
    rs.mode.general()
    logits = (torch.randn(3, 700, generator=torch.Generator().manual_seed(6)) * 3).to(torch.bfloat16).to(DEV)
    batch = SimpleNamespace(rows=torch.tensor([1, 4, 5], device=DEV))
    firsts = []
    for kernels in (DRAW, None):
        slots = SimpleNamespace(sampling=rs, last=torch.zeros(len(SETTINGS), dtype=torch.long, device=DEV))
        firsts.append(first_tokens(logits, slots, batch, kernels))
        assert torch.equal(slots.last[batch.rows], firsts[-1])
    assert calls == [(3, 700)]
    assert torch.equal(*firsts)


if cut_draw.triton is not None:
    import triton
    import triton.language as tl

    @triton.jit
    def kth_kernel(x_ptr, n, hist_ptr, k_ptr, out_ptr, NR, NS, S_POW: tl.constexpr, LEVELS: tl.constexpr,
                   SLICES: tl.constexpr):
        r = tl.program_id(0)
        k = tl.load(k_ptr + r)
        if SLICES:
            value = cut_draw.key_value(cut_draw.radix_prefix(hist_ptr, r, NR, NS, S_POW, k, LEVELS), LEVELS)
        else:
            value = cut_draw.kth_value(x_ptr + r * n, n, k, LEVELS, 256)
        tl.store(out_ptr + r, value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_radix_select_finds_the_kth_largest(dtype):
    """Top-k's threshold, the radix select (in one program a row, and over slices' histograms),
    equals torch.topk's k-th value over rows of many ties, both signs, -0.0, -inf and a row length
    that is not a multiple of the chunk (float32: values that differ in their lowest byte)."""
    gen = torch.Generator().manual_seed(7)
    n, r, s_len = 700, 6, 256
    x = (torch.randn(r, n, generator=gen) * 4).to(dtype).float()
    x[1] = (x[1] * 2).round() / 2  # many ties
    x[2, ::3] = -float("inf")
    x[3, :350] = -0.0
    x[3, 350:] = -x[3, 350:].abs()  # all negative
    x[4] = 1.0 + torch.arange(n) * 2.0 ** -23 if dtype == torch.float32 else x[4]
    x = x.to(dtype).to(DEV)
    ks = torch.tensor([1, 37, 300, 400, n // 2, n - 1]).to(DEV)
    want = torch.stack([x[i].float().cpu().topk(int(ks[i])).values[-1] for i in range(r)])
    levels, s = cut_draw.LEVELS[dtype], triton.cdiv(n, s_len)
    hist = torch.empty(levels, r, s, 256, dtype=torch.int32, device=DEV)
    ones = torch.ones(r, device=DEV)
    for level in range(levels):
        cut_draw.kth_part_kernel[(r, s)](x, n, n, 1, ones, ks, hist, r, s, S_POW=4, LEVEL=level, SLICE=s_len)
    for slices in (False, True):
        out = torch.empty(r, device=DEV)
        kth_kernel[(r,)](x, n, hist, ks, out, r, s, S_POW=4, LEVELS=levels, SLICES=slices)
        assert torch.equal(out.cpu(), want), (slices, out, want)


def test_rows_the_launched_checks_leave_undecided_finish_alike(monkeypatch):
    """With no nucleus check launched over slices, every top-p row finishes its walk in one program:
    the same draws as the sort."""
    monkeypatch.setattr(cut_draw, "SPLIT", True)
    monkeypatch.setattr(cut_draw, "ROUNDS", 0)
    gen = torch.Generator().manual_seed(11)
    rs = rows_of(SETTINGS)
    logits = (torch.randn(len(SETTINGS), 3000, generator=gen) * 3).to(torch.bfloat16).to(DEV)
    assert torch.equal(rs.pick(logits, 2, DRAW), rs.pick(logits, 2))
