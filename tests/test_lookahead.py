"""Lookahead (runtime/decoder.py): launching step t+1 before collecting step t changes nothing but
timing. On the CPU a step runs while it is launched, so these tests force lookahead on and check
what it must keep: the same tokens and finish reasons as the synchronous loop (rows that stop on
EOS run one step past it, and those tokens are dropped), host mirrors equal to the device, and in
the server's Batcher, rows released or admitted while a step is in flight get exactly their own
tokens."""
import pytest
import torch

from eaglet import GenerationConfig, Generator, load_model
from eaglet.config import SpecConfig
from eaglet.sampling import SamplingParams
from eaglet.server import batcher as batcher_mod
from eaglet.server.batcher import Batcher
from eaglet.server.engine import Request
from eaglet.spec.speculator import Speculator

from .test_spec_greedy import random_head

SPECS = {"plain": None, "chain4": dict(steps=4), "tree3x3": dict(steps=3, topk=3, draft_tokens=8)}


@pytest.fixture(scope="module")
def target(tiny_dirs):
    return load_model(tiny_dirs["llama3"][0], dtype="float32", device="cpu", tokenizer=False).model


@pytest.fixture(scope="module")
def prompts():
    return [torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(s)).tolist()
            for s, n in enumerate([4, 9, 2, 13, 6])]


def speculator(model, name: str, perfect: bool = False) -> Speculator | None:
    if SPECS[name] is None:
        return None
    spec = SpecConfig("draft" if perfect else "eagle3", **SPECS[name])
    return Speculator(spec, draft_model=model) if perfect else Speculator(spec, head=random_head(model.config))


def counting(gen: Generator, model, batch: int, max_len: int) -> list[int]:
    """Make gen's decoder record how many steps were in flight after each launch."""
    seen: list[int] = []
    dec = gen.decoder(batch, max_len)
    launch = dec.launch

    def counted():
        launch()
        seen.append(len(dec.in_flight))
    dec.launch = counted
    return seen


@pytest.mark.parametrize("name,perfect", [("plain", False), ("chain4", False), ("tree3x3", False),
                                          ("chain4", True), ("tree3x3", True)])
def test_same_tokens_and_stops_as_sync(target, prompts, name, perfect):
    """perfect: the target drafts for itself, so steps emit several tokens and overrun by more."""
    sync = Generator(target, None, speculator(target, name, perfect), lookahead=False)
    ahead = Generator(target, None, speculator(target, name, perfect), lookahead=True)
    free = sync.generate([prompts[0]], GenerationConfig(max_new_tokens=40, ignore_eos=True))[0].tokens
    eos = free[17]  # a token that row 0 emits mid-way: rows stop on it at different steps
    for g in (sync, ahead):
        g.eos_ids = lambda eos=eos: frozenset({eos})
    cfg = GenerationConfig(max_new_tokens=40)
    seen = counting(ahead, target, len(prompts), 128)
    want = sync.generate(prompts, cfg)
    got = ahead.generate(prompts, cfg)
    assert [c.tokens for c in got] == [c.tokens for c in want]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in want]
    assert {c.finish_reason for c in want} == {"stop", "length"}  # both ways of stopping are exercised
    assert max(seen) == 2  # steps really were launched ahead of collection
    dec = ahead.decoder_in_use()
    host = dec.cache.host_lens.copy()
    dec.cache.sync_host()
    assert host.tolist() == dec.cache.host_lens.tolist()  # the host mirror kept up with the device
    # the device stopped each row at its EOS: nothing past the stop in its cache (the stopping
    # token itself is emitted, not yet fed back)
    stopped = [i for i, c in enumerate(got) if c.finish_reason == "stop"]
    assert [int(dec.cache.host_lens[i]) for i in stopped] == [len(prompts[i]) + len(got[i].tokens) - 1
                                                             for i in stopped]
    if name != "plain":
        assert [c.spec.drafts for c in got] == [c.spec.drafts for c in want]
        assert [c.spec.accepted_per_pos for c in got] == [c.spec.accepted_per_pos for c in want]


def test_sampled_lookahead_is_reproducible(target, prompts):
    """Seeded sampling with lookahead: the rows a step covers depend only on what the host has
    seen, never on timing, so the same seed gives the same text. (Against the synchronous loop
    it may differ: there a row that used up its budget leaves the step's rows one step earlier,
    and a smaller step draws fewer random numbers.)"""
    cfg = GenerationConfig(max_new_tokens=24, ignore_eos=True,
                           sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=3))
    outs = [Generator(target, None, speculator(target, "chain4"), lookahead=True).generate(prompts[:3], cfg)
            for _ in range(2)]
    assert [c.tokens for c in outs[0]] == [c.tokens for c in outs[1]]
    assert len({tuple(c.tokens) for c in outs[0]}) == 3


class Logged(batcher_mod.Sequence):
    """A server Sequence that keeps the token ids it took."""

    def push_many(self, tokens):
        text, n = super().push_many(tokens)
        self.__dict__.setdefault("log", []).extend(tokens[:n])
        return text, n


@pytest.mark.parametrize("name,trip", [("plain", 1), ("chain4", 1), ("plain", 3), ("chain4", 3)])
def test_batcher_rows_change_while_a_step_is_in_flight(target, prompts, name, trip, monkeypatch):
    """Two rows, five requests: finished and cancelled rows are refilled while a step (a trip of
    `trip` steps: the server's --multi-step) is in flight, their first tokens coming with the next
    step's; every request gets exactly the tokens it gets alone (the cancelled one a prefix)."""
    monkeypatch.setattr(batcher_mod, "Sequence", Logged)
    budgets = [14, 6, 9, 11, 7]
    alone = Generator(target, None, lookahead=False)
    want = [alone.generate([p], GenerationConfig(max_new_tokens=n, ignore_eos=True))[0].tokens
            for p, n in zip(prompts, budgets)]
    b = Batcher.of(Generator(target, None, speculator(target, name), lookahead=True), 2, 64)
    b.dec.trip = trip
    reqs = [Request(p, n, SamplingParams(), ignore_eos=True) for p, n in zip(prompts, budgets)]
    seqs, waiting, in_flight, steps, deferred = {}, list(reqs), [], 0, 0

    def take(outputs):
        for o in outputs:
            seqs[id(o.seq.request)] = o.seq
            if o.finished:
                b.release(o.row)

    while waiting or b.running:
        if waiting and b.free_rows:
            n = len(b.free_rows)
            ahead = bool(b.dec.in_flight)
            out = b.add(waiting[:n])
            deferred += ahead and not out  # admitted beside steps in flight: first tokens come with a step
            take(out)
            del waiting[:n]
        take(b.step())
        in_flight.append(len(b.dec.in_flight))
        steps += 1
        if steps == 3:  # request 0's client goes away mid-stream: its row is freed and refilled
            b.release(reqs[0].row)
    assert max(in_flight) == trip  # a trip was in flight while rows were released and admitted
    assert deferred > 0
    cut = seqs[id(reqs[0])].log
    assert 0 < len(cut) < budgets[0] and cut == want[0][:len(cut)]
    for r, w in zip(reqs[1:], want[1:]):
        assert seqs[id(r)].log == w and seqs[id(r)].finish_reason == "length"
    assert not b.dec.in_flight and b.dec.cache.host_lens.sum() == 0  # idle: drained, every slot free
    b.dec.cache.sync_host()
    assert b.dec.cache.host_lens.sum() == 0


@pytest.mark.parametrize("name", ["plain", "chain4"])
def test_rows_finishing_together_are_freed_in_one_release(target, prompts, name, monkeypatch):
    """Three requests of one budget finish in the same step; one release_rows (a row named twice)
    frees all three rows, their cache and their limits, and the rows refilled give what the
    requests give alone."""
    monkeypatch.setattr(batcher_mod, "Sequence", Logged)
    b = Batcher.of(Generator(target, None, speculator(target, name), lookahead=True), 3, 64)
    releases = []
    real = b.dec.release
    monkeypatch.setattr(b.dec, "release", lambda rows: releases.append(list(rows)) or real(rows))
    alone = Generator(target, None, lookahead=False)
    for round_ in range(2):
        reqs = [Request(p, 8, SamplingParams(), ignore_eos=True) for p in prompts[round_:round_ + 3]]
        seqs, finished = {}, []
        out = b.add(reqs)
        while b.running:
            for o in out:
                seqs[id(o.seq.request)] = o.seq
                finished += [o.row] if o.finished else []
            if finished:
                b.release_rows(finished + finished[:1])
                finished = []
            out = b.step() if b.running else []
        assert releases[-1] == [0, 1, 2] or name != "plain"  # plain rows end in one step together
        assert b.free_rows == [0, 1, 2] and b.kv_used == 0 and not b.dec.live.any()
        for r in reqs:
            want = alone.generate([r.prompt], GenerationConfig(max_new_tokens=8, ignore_eos=True))[0].tokens
            assert seqs[id(r)].log == want


@pytest.mark.parametrize("name", ["plain", "chain4"])
def test_steps_cover_only_rows_in_use(target, prompts, name, monkeypatch):
    """A step runs over the smallest bucket of rows that holds every running row: a lone request in
    a four-row batch steps one row, and its tokens are those it gets alone."""
    monkeypatch.setattr(batcher_mod, "Sequence", Logged)
    want = Generator(target, None, lookahead=False).generate(
        [prompts[1]], GenerationConfig(max_new_tokens=10, ignore_eos=True))[0].tokens
    b = Batcher.of(Generator(target, None, speculator(target, name), lookahead=True), 4, 64)
    sizes = []
    prefix = b.dec.prefix
    b.dec.prefix = lambda k: sizes.append(k) or prefix(k)
    req = Request(prompts[1], 10, SamplingParams(), ignore_eos=True)
    out = b.add([req])
    seq = out[0].seq
    while not seq.finish_reason:
        b.step()
    assert set(sizes) == {1}
    view = b.dec.prefix(1).slots
    assert view.batch == 1 and view.cache.k.data_ptr() == b.dec.cache.k.data_ptr()
    assert seq.log == want


@pytest.mark.parametrize("lookahead", [False, True])
def test_batcher_turns_plain_mid_sequence(target, prompts, lookahead, monkeypatch):
    """A speculating batch turns plain after 3 steps (a step in flight with lookahead), then takes
    in a new request: every request gets exactly its greedy tokens, the first one's drafts stop
    at the switch, and after the batch ends its decoder speculates again (the same step, whose row
    views and their graphs are kept)."""
    monkeypatch.setattr(batcher_mod, "Sequence", Logged)
    alone = Generator(target, None, lookahead=False)
    want = [alone.generate([p], GenerationConfig(max_new_tokens=20, ignore_eos=True))[0].tokens for p in prompts[:3]]
    gen = Generator(target, None, speculator(target, "chain4"), lookahead=lookahead)
    b = Batcher.of(gen, 3, 64)
    reqs = [Request(p, 20, SamplingParams(), ignore_eos=True) for p in prompts[:3]]
    seqs = {}

    def take(outputs):
        for o in outputs:
            seqs[id(o.seq.request)] = o.seq
            if o.finished:
                b.release(o.row)

    take(b.add(reqs[:2]))
    for _ in range(3):
        take(b.step())
    assert len(b.dec.in_flight) == (1 if lookahead else 0)
    spec = b.dec.current
    view = b.dec.prefix(2)  # the row view the speculative steps ran on
    drafts = spec.metrics[0].drafts
    take(b.use(b.dec.plain))
    assert not b.dec.in_flight and spec.metrics[0].drafts == drafts + (1 if lookahead else 0)
    assert b.dec.current is b.dec.plain
    take(b.add(reqs[2:]))
    while b.running:
        take(b.step())
    assert [seqs[id(r)].log for r in reqs] == want
    assert seqs[id(reqs[0])].spec.drafts == drafts + (1 if lookahead else 0)  # no drafting after the switch
    assert seqs[id(reqs[2])].spec.drafts == 0
    again = Batcher.of(gen, 3, 64)  # the same decoder, every row free: speculating again
    assert again.dec is b.dec and again.dec.current is spec
    # the row views are kept through both switches (a captured graph reads a view's own proposal
    # buffers: a new view would draft into others)
    assert again.dec.prefix(2) is view
    out = again.add([Request(prompts[3], 8, SamplingParams(), ignore_eos=True)])
    while again.running:
        for o in again.step():
            if o.finished:
                again.release(o.row)
    assert out[0].seq.spec.drafts > 0


def test_first_token_of_an_admission_beside_steps_comes_first(target, prompts):
    """Admitted while a step is in flight, a prompt's first token is not waited for (admit returns
    None); it comes out before the row's tokens of the steps after it, also when those steps are
    collected by a switch of step (use)."""
    want = Generator(target, None, lookahead=False).generate(
        [prompts[1]], GenerationConfig(max_new_tokens=6, ignore_eos=True))[0].tokens
    dec = Generator(target, None, speculator(target, "chain4"), lookahead=True).decoder(2, 64)
    dec.admit([0], [prompts[0]])
    dec.set_rows([0], [10])
    dec.launch()  # a step in flight
    assert dec.admit([1], [prompts[1]], wait=False) is None
    dec.set_rows([1], [5])
    dec.launch()  # the step after the admission
    row1 = [t for step in dec.use(dec.plain) for t in step[1]]
    assert len(row1) >= 2 and row1 == want[:len(row1)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("spec", [None, SpecConfig("draft", steps=4), SpecConfig("draft", steps=3, topk=2, draft_tokens=6)],
                         ids=["plain", "draft-chain4", "draft-tree3x2"])
@torch.inference_mode()
def test_served_rows_come_and_go_without_a_host_sync(tiny_dirs, spec):
    """On the GPU, once its graphs are warm, a server's batch admits beside steps in flight, steps
    and releases finished rows without ever making the host wait for the device, other than the one
    labelled wait a step (an event) and an admission's first tokens when nothing is in flight (not
    checked): a sync hidden in that path (a pageable copy, an index built from a Python list) makes
    the host wait for the steps in flight and drains the lookahead pipeline."""
    gpu = load_model(tiny_dirs["llama3"][0], dtype="float32", device="cuda", tokenizer=False).model
    sp = Speculator(spec, draft_model=gpu) if spec is not None else None
    b = Batcher.of(Generator(gpu, None, sp, lookahead=True), 4, 200)  # warm-up captures spans of 128 and up
    assert b.dec.warmup(prompt_tokens=16) > 0
    prompts = [[5 + i, 17, 33, 2 * i + 40, 9, 11][: 3 + i % 4] for i in range(10)]
    waiting = [Request(p, 6 + 3 * (i % 4), SamplingParams(), ignore_eos=True) for i, p in enumerate(prompts)]
    done, beside = 0, 0
    while waiting or b.running:
        if waiting and b.free_rows:
            n = len(b.free_rows)
            if b.dec.in_flight:  # beside steps in flight: nothing may wait
                beside += 1
                torch.cuda.set_sync_debug_mode("error")
            try:
                outputs = b.add(waiting[:n])
            finally:
                torch.cuda.set_sync_debug_mode(0)
            del waiting[:n]
        torch.cuda.set_sync_debug_mode("error")
        try:
            outputs += b.step()
            for o in outputs:
                if o.finished:
                    b.release(o.row)
                    done += 1
        finally:
            torch.cuda.set_sync_debug_mode(0)
        outputs = []
    assert done == len(prompts) and beside > 0
