"""Greedy speculative decoding is lossless: for every drafter (EAGLE-3 head, n-gram, draft model), as
a chain and as a tree, the output equals plain greedy decoding token for token.

Equal outputs alone would pass with a drafter that is never accepted, so every run is also replayed
step by step against the plain output: each verify step must emit exactly the plain continuation
along the deepest path of the proposed tree that follows it, then the bonus token (cut only by the
token budget), and the speculation metrics must add up to what the steps did.
"""
import copy
from collections import Counter

import pytest
import torch

from eaglet import GenerationConfig, Generator, load_model
from eaglet.config import SpecConfig
from eaglet.kernels import EAGER, Kernels
from eaglet.spec.drafters.eagle3_head import Eagle3Config, Eagle3Head
from eaglet.spec.speculator import Speculator

from .conftest import hf_model, once_per_run

GREEDY = GenerationConfig(max_new_tokens=64, ignore_eos=True)
SHAPES = {"chain3": dict(steps=3), "chain5": dict(steps=5), "tree3x3": dict(steps=3, topk=3, draft_tokens=8)}


class Recorder:
    """Wraps a drafter; keeps each step's proposals and emitted tokens on the host. A step over the
    first k rows (rows(k)) records its k rows' proposals; rows past them have none (None)."""

    def __init__(self, inner):
        self.inner, self.taps, self.graphable, self.steps = inner, inner.taps, False, []
        self.last = [None]  # the latest proposal, shared with the row views

    def rows(self, k):
        v = copy.copy(self)
        v.inner = self.inner.rows(k)
        return v

    def start(self, batch, taps, first):
        self.inner.start(batch, taps, first)

    def start_host(self, rows, prompts, first):
        self.inner.start_host(rows, prompts, first)

    def propose(self, roots, sampling=None):
        self.last[0] = self.inner.propose(roots, sampling)
        return self.last[0]

    def commit(self, prop, res, taps):
        self.inner.commit(prop, res, taps)

    def commit_host(self, emitted):
        p = self.last[0]
        pad = [None] * (len(emitted) - p.tokens.shape[0])
        self.steps.append((p.tokens.tolist() + pad, p.parents.tolist() + pad, p.valid.tolist() + pad, emitted))
        self.inner.commit_host(emitted)

    def release(self, rows):
        self.inner.release(rows)


class Recording(Speculator):
    def make(self, *args):
        self.rec = Recorder(super().make(*args))
        return self.rec


def path_depth(tokens, parents, valid, want) -> int:
    """How many of want[0], want[1], ... a root-to-leaf path of the tree spells out."""
    node = depth = 0
    while depth < len(want):
        kids = [j for j in range(len(tokens)) if valid[j] and parents[j] == node and tokens[j] == want[depth]]
        if not kids:
            break
        node, depth = kids[0], depth + 1
    return depth


def replay(steps, row: int, ref: list[int]) -> list[tuple[int, int, int, int]]:
    """Check every step of `row` against the plain output `ref`; per active step return
    (accepted drafts, drafted tokens, deepest drafted position, depth of ref's path in the tree)."""
    pos, out = 0, []  # ref[pos] is the root of the next step
    for tokens, parents, valid, emitted in steps:
        tokens, parents, valid, emitted = tokens[row], parents[row], valid[row], emitted[row]
        if pos + 1 == len(ref):  # finished: a frozen row emits nothing (and may be past the step's rows)
            assert emitted == []
            continue
        assert tokens is not None, "a running row was left out of the step"
        assert tokens[0] == ref[pos] and parents[0] == -1
        want = ref[pos + 1:]
        depth = path_depth(tokens, parents, valid, want)
        assert emitted == want[:depth + 1], f"step {len(out)}: accepted path + bonus"
        node_depth = [0] * len(tokens)
        for j in range(1, len(tokens)):
            assert 0 <= parents[j] < j or not valid[j]  # parents before children
            node_depth[j] = node_depth[parents[j]] + 1
        reach = max(d for d, v in zip(node_depth, valid) if v)
        out.append((len(emitted) - 1, sum(valid) - 1, reach, depth))
        pos += len(emitted)
    assert pos + 1 == len(ref)
    return out


def check_metrics(m, steps: list[tuple[int, int, int, int]], n_tokens: int) -> None:
    """SpecMetrics are exactly the sums of what the steps did (loop.py: one record per verify)."""
    accepted = [s[0] for s in steps]
    assert m.drafts == len(steps) and m.accepted_tokens == sum(accepted)
    assert n_tokens == 1 + m.drafts + m.accepted_tokens  # the prefill's token, then accepted + bonus per step
    assert m.draft_tokens == sum(s[1] for s in steps)
    assert m.accept_length == pytest.approx((n_tokens - 1) / m.drafts)  # tokens emitted by verify steps, per step
    depth = max(s[2] for s in steps)
    assert m.accepted_per_pos == [sum(a > i for a in accepted) for i in range(depth)]
    assert m.drafts_reaching_pos == [sum(s[2] > i for s in steps) for i in range(depth)]
    assert sum(m.accepted_per_pos) == m.accepted_tokens


def run_checked(model, prompts, ref, speculator: Recording, gen: GenerationConfig = GREEDY):
    """Speculative generation that must equal `ref`; returns (completions, per-row step tuples)."""
    outs = Generator(model, None, speculator).generate(prompts, gen)
    rows = []
    for row, (c, r) in enumerate(zip(outs, ref)):
        assert c.tokens == r, f"prompt {row} differs from plain greedy"
        steps = replay(speculator.rec.steps, row, r)
        check_metrics(c.spec, steps, len(r))
        rows.append(steps)
    return outs, rows


def tau(outs) -> float:
    """Tokens per verify step over the whole batch (bonus included)."""
    return sum(len(c.tokens) - 1 for c in outs) / sum(c.spec.drafts for c in outs)


# ---- tiny random target ---------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["llama3", "mistral"])  # mistral: sliding window 8
def tiny(request, tiny_dirs):
    """(target, 24 prompts of 1..20 tokens, plain greedy of each prompt run alone)."""
    model = load_model(tiny_dirs[request.param][0], dtype="float32", device="cpu", tokenizer=False).model
    lengths = [3, 5, 8, 13, 1, 20, 7, 9, 11, 4, 6, 2, 15, 10, 12, 17, 3, 8, 5, 19, 14, 6, 16, 18]
    prompts = [torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(s)).tolist()
               for s, n in enumerate(lengths)]
    plain = Generator(model, None)
    return model, prompts, [plain.generate([p], GREEDY)[0].tokens for p in prompts]


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory):
    """A smaller random model (2 layers, hidden 32) with the tiny target's vocabulary."""
    d = tmp_path_factory.mktemp("small_draft")
    hf_model("llama3", seed=1, num_hidden_layers=2, hidden_size=32, intermediate_size=48).save_pretrained(d)
    return load_model(d, dtype="float32", device="cpu", tokenizer=False).model


def random_head(cfg, vocab: torch.Tensor | None = None, kernels: Kernels = EAGER) -> Eagle3Head:
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.for_target(cfg, draft_vocab_size=None if vocab is None else len(vocab)), kernels)
    if vocab is not None:
        head.set_vocab(vocab)
    return head.eval()


def recording(drafter: str, spec: SpecConfig, target, draft_model=None) -> Recording:
    """A recorded speculator by drafter name: a random EAGLE-3 head for `target`, n-gram lookup, or
    `draft_model`."""
    return {"eagle3": lambda: Recording(spec, head=random_head(target.config)), "ngram": lambda: Recording(spec),
            "draft": lambda: Recording(spec, draft_model=draft_model)}[drafter]()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("drafter", ["eagle3", "eagle3-vocab", "ngram", "draft"])
def test_equals_plain_greedy(tiny, small_draft, drafter, shape):
    model, prompts, ref = tiny
    vocab = torch.randperm(128, generator=torch.Generator().manual_seed(0))[:48].sort().values
    spec = SpecConfig(drafter.split("-")[0], **SHAPES[shape])
    sp = {"eagle3": Recording(spec, head=random_head(model.config)),
          "eagle3-vocab": Recording(spec, head=random_head(model.config, vocab)),
          "ngram": Recording(spec), "draft": Recording(spec, draft_model=small_draft)}[drafter]
    outs, rows = run_checked(model, prompts, ref, sp)
    drafted = {t for tokens, _, valid, _ in sp.rec.steps for tr, vr in zip(tokens, valid)
               if tr is not None for t, v in zip(tr[1:], vr[1:]) if v}
    if drafter == "eagle3-vocab":  # drafts are mapped from the draft vocabulary to target ids
        assert drafted <= set(vocab.tolist()) and not drafted <= set(range(48))
    if drafter == "ngram":  # a random tiny model falls into loops, which n-gram lookup predicts
        assert tau(outs) > 1.2
    if spec.is_chain and drafter != "ngram":
        assert all(s[1] == spec.steps and s[2] == spec.steps for r in rows for s in r)


def test_equals_plain_greedy_where_the_cpu_takes_f_linear(tiny, monkeypatch):
    """On a host whose few-row matmuls take F.linear (models/linear.py `cpu_wxt`), a verify's rows are
    not rounded as a decode step's row; greedy speculation still equals plain greedy under it."""
    from eaglet.models import linear

    monkeypatch.setattr(linear, "cpu_wxt", lambda: False)
    model, prompts, _ = tiny
    ref = [Generator(model, None).generate([p], GREEDY)[0].tokens for p in prompts]
    for shape in ("chain5", "tree3x3"):
        run_checked(model, prompts, ref, Recording(SpecConfig("eagle3", **SHAPES[shape]), head=random_head(model.config)))


@pytest.mark.parametrize("k", [3, 5])
def test_perfect_chain_accepts_everything(tiny, k):
    """A draft model identical to the target: every step accepts all k drafts plus the bonus."""
    model, prompts, ref = tiny
    m = 10
    gen = GenerationConfig(max_new_tokens=1 + m * (k + 1), ignore_eos=True)
    outs, rows = run_checked(model, prompts, [r[:gen.max_new_tokens] for r in ref],
                             Recording(SpecConfig("draft", steps=k), draft_model=model), gen)
    for c, steps in zip(outs, rows):
        assert c.spec.drafts == m and c.spec.accept_length == k + 1
        assert c.spec.acceptance_rate_per_pos == [1.0] * k
        assert all(s[0] == s[3] == k for s in steps)


@pytest.mark.parametrize("steps,topk", [(2, 3), (3, 3), (4, 2)])
def test_perfect_tree_accepts_the_argmax_path(tiny, steps, topk):
    """Identical draft model, full tree budget: each step accepts the whole target-argmax path the
    tree holds (replay checks accepted == its depth). The root's argmax child is always expanded,
    so that depth is >= 2; it is the full depth when steps == 2 (every level-1 node is expanded),
    deeper levels keep only the best `topk` by cumulative probability, which may drop the path."""
    model, prompts, ref = tiny
    full = 1 + topk + (steps - 1) * topk ** 2
    spec = SpecConfig("draft", steps=steps, topk=topk, draft_tokens=full)
    outs, rows = run_checked(model, prompts, ref, Recording(spec, draft_model=model))
    for steps_of_row in rows:
        assert all(s[1] == full - 1 and s[2] == steps for s in steps_of_row)
        assert all(s[3] >= 2 for s in steps_of_row[:-1])
        if steps == 2:
            assert all(s[0] == 2 for s in steps_of_row)  # 64 = 1 + 21 * 3: no step is cut
    assert tau(outs) > 3.0 if steps > 2 else tau(outs) == 3.0


def test_eagle3_commit_path_with_acceptance(tiny):
    """A head with all-zero logits always drafts its first draft-vocabulary id; made the target's most
    frequent output token, its runs are accepted, through EAGLE-3's commit and catch-up."""
    model, prompts, ref = tiny
    top = Counter(t for r in ref for t in r).most_common(1)[0][0]
    head = random_head(model.config, torch.arange(top, 128))
    torch.nn.init.zeros_(head.lm_head.weight)
    sp = Recording(SpecConfig("eagle3", steps=3), head=head)
    outs, rows = run_checked(model, prompts, ref, sp)
    assert all(tr[1:] == [top] * 3 for tokens, *_ in sp.rec.steps for tr in tokens if tr is not None)
    assert sum(c.spec.accepted_tokens for c in outs) >= 20 and max(s[0] for r in rows for s in r) == 3


# ---- the real SmolLM2-135M-Instruct ---------------------------------------------------------------

CHAT = ["What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis simply.",
        "What is 17 times 23?", "Who wrote Romeo and Juliet?", "Why is the sky blue?",
        "Write a short story opening about a lighthouse keeper.", "What does a compiler do?",
        "List the days of the week, then list them again.",
        "Write the word 'banana' twenty times, separated by spaces.",
        "Count from 1 to 40, separated by commas.", "Print the numbers from 1 to 30, one per line.",
        "Write the alphabet in capital letters, twice.",
        "Repeat after me: I like apples. I like apples. I like apples."]
REPETITIVE = range(8, 14)
# small verify budgets: on CPU the cost is the number of verified tokens (rows x nodes x steps)
SMOL_SPECS = {"ngram-chain": SpecConfig("ngram", steps=3),
              "ngram-tree": SpecConfig("ngram", steps=3, topk=2, draft_tokens=6),
              "eagle3-chain": SpecConfig("eagle3", steps=3),
              "eagle3-tree": SpecConfig("eagle3", steps=3, topk=2, draft_tokens=6)}


SMOL_GREEDY = GenerationConfig(max_new_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def smol(smollm2, tmp_path_factory):
    """(model, chat prompts, plain greedy of them in one batch of 14 (computed once per test run), the
    bundled EAGLE-3 head: a trained one accepts deep paths, and its fewer verify steps are what
    keeps these runs short on the CPU)."""
    from eaglet.spec.speculator import bundled_drafter, load_speculator

    lm = smollm2
    prompts = [lm.tokenizer.apply_chat([{"role": "user", "content": c}]) for c in CHAT]
    ref = once_per_run(tmp_path_factory, "smollm2-greedy",
                       lambda: [c.tokens for c in Generator(lm.model, None).generate(prompts, SMOL_GREEDY)])
    head = load_speculator(SpecConfig("eagle3", str(bundled_drafter())), lm.model).head
    return lm.model, prompts, ref, head


def smol_speculator(name: str, head) -> Recording:
    spec = SMOL_SPECS[name]
    return Recording(spec, head=head) if spec.method == "eagle3" else Recording(spec)


@pytest.mark.slow
@pytest.mark.parametrize("name", SMOL_SPECS)
def test_smollm2_equals_plain_greedy(smol, name):
    model, prompts, ref, head = smol
    outs, _ = run_checked(model, prompts, ref, smol_speculator(name, head), SMOL_GREEDY)
    if name.startswith("ngram"):
        assert tau([outs[i] for i in REPETITIVE]) > 1.5


@pytest.mark.slow
def test_smollm2_batch_rows_equal_each_prompt_alone(smol):
    """Rows of different lengths, accepting different numbers of tokens per step, stay independent."""
    model, prompts, ref, head = smol
    picks = (0, 6, 9, 10)
    batch = [prompts[i] for i in picks]
    assert len({len(p) for p in batch}) == 4
    gen = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    alone = [Generator(model, None).generate([p], gen)[0].tokens for p in batch]
    assert alone == [ref[i][:16] for i in picks]  # the batched plain reference agrees too
    outs, _ = run_checked(model, batch, alone, smol_speculator("ngram-tree", head), gen)
    assert len({c.spec.accepted_tokens for c in outs}) > 1


def test_row_counters_are_per_row_spec_metrics():
    """RowCounters (a batch's draft counters as arrays, steps' records folded in when read) hold,
    for every row, the sums over the drafts it made since its last reset, and `take` the sums over
    all rows of the steps recorded since the last take; per-position lists run to the deepest
    position any draft reached."""
    import numpy as np

    from eaglet.spec.metrics import RowCounters, SpecMetrics

    def expect(drafts: list[tuple[int, int, int]]) -> SpecMetrics:  # (accepted, drafted, reach) each
        depth = max((m for _, _, m in drafts), default=0)
        return SpecMetrics(len(drafts), sum(d for _, d, _ in drafts), sum(a for a, _, _ in drafts),
                           [sum(a > i for a, _, _ in drafts) for i in range(depth)],
                           [sum(m > i for _, _, m in drafts) for i in range(depth)])

    rng = np.random.default_rng(0)
    rows, depth = 8, 5
    counters, made, since = RowCounters(rows, depth), [[] for _ in range(rows)], []
    for step in range(40):
        if step == 20:  # rows 1 and 3 taken by new requests
            counters.reset([1, 3])
            made[1], made[3] = [], []
        drew = sorted(rng.choice(rows, size=int(rng.integers(1, rows + 1)), replace=False).tolist())
        reach = rng.integers(0, depth + 1, len(drew))
        accepted = np.array([rng.integers(0, r + 1) for r in reach])
        drafted = reach + rng.integers(0, 10, len(drew))
        this = [(int(a), int(d), int(m)) for a, d, m in zip(accepted, drafted, reach)]
        for r, t in zip(drew, this):
            made[r].append(t)
        counters.record(drew, accepted, drafted, reach)
        since += this
        if step % 3 == 2:  # several steps' records folded at once, as a trip of steps is
            assert counters.take() == expect(since)
            since = []
    assert [counters.of(r) for r in range(rows)] == counters.every() == [expect(m) for m in made]
    assert counters.take() == expect(since)
    counters.reset([2])
    assert counters.every()[2] == counters.of(2) == SpecMetrics()
