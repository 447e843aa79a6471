"""Graph warm-up before serving (Decoder.warmup, Engine.warmup), checked on the CPU with a
graph runner that records keys instead of capturing: after the warm-up, every graph a run of
requests meets has already been called twice (so it was captured), and the decoder is left
exactly as a fresh one (every row free; the same tokens afterwards)."""
from collections import Counter

import pytest
import torch

from eaglet import load_model
from eaglet.config import SpecConfig
from eaglet.runtime.decoder import Decoder
from eaglet.runtime.graphs import GraphRunner
from eaglet.sampling import SamplingParams
from eaglet.server.batcher import Batcher
from eaglet.server.engine import Request
from eaglet.spec.loop import spec_decoder
from eaglet.spec.speculator import Speculator

from .test_spec_greedy import random_head


class Recording(GraphRunner):
    """A runner that counts calls per key: a key called twice would have been captured."""

    def __init__(self):
        super().__init__(torch.device("cpu"), enabled=False)
        self.enabled, self.calls = True, Counter()

    def run(self, key, body, graph=True):
        if graph:
            self.calls[key] += 1
        return body()

    @property
    def captured(self) -> int:
        return sum(n >= 2 for n in self.calls.values())


@pytest.fixture(scope="module")
def target(tiny_dirs):
    return load_model(tiny_dirs["llama3"][0], dtype="float32", device="cpu", tokenizer=False).model


def make(target, kind: str, batch: int = 4):
    if kind == "plain":
        dec = Decoder(target, batch, 300, graphs=False)
    else:
        sp = Speculator(SpecConfig("eagle3", steps=3), head=random_head(target.config))
        dec = spec_decoder(target, sp.make(target, batch, 300), sp.spec, batch, 300,
                           graphs=False)
    dec.graphs = Recording()
    return dec


class Gen:
    """What Batcher needs of a Generator, around a prepared decoder."""
    def __init__(self, dec):
        self.dec, self.tokenizer, self.speculator = dec, None, None

    def eos_ids(self):
        return frozenset()

    def decoder(self, *a):
        self.dec.free_all()
        return self.dec


def serve(dec, plan: list[tuple[int, int]], at_most: int | None = None, group: int = 1,
          settings=(SamplingParams(),)) -> None:
    """Requests (prompt length, max tokens), with the given settings in turn, admitted up to
    `group` at a time as soon as rows are free (and fewer than `at_most` run)."""
    b = Batcher.of(Gen(dec), dec.batch, 300)
    waiting = [Request([(7 * i + j) % 100 + 3 for j in range(n)], m, settings[i % len(settings)], ignore_eos=True)
               for i, (n, m) in enumerate(plan)]
    while waiting or b.running:
        room = min(len(b.free_rows), (at_most or dec.batch) - b.running, group)
        if waiting and room > 0:
            b.add([waiting.pop(0) for _ in range(min(room, len(waiting)))])
        for o in b.step():
            if o.finished:
                b.release(o.row)


PLAN = [(40, 30), (150, 20), (5, 60), (120, 12), (33, 40), (200, 30), (9, 9)]


@pytest.mark.parametrize("kind", ["plain", "eagle3"])
def test_warmup_covers_what_requests_meet(target, kind):
    dec = make(target, kind)
    step = dec.current
    n = dec.warmup(plain_rows=4) if kind == "eagle3" else dec.warmup()
    assert n == dec.graphs.captured > 0
    assert not dec.in_flight and not dec.live.any() and dec.cache.host_lens.sum() == 0
    assert int(dec.cache.lens.sum()) == 0 and dec.current is step
    warm = {k for k, c in dec.graphs.calls.items() if c >= 2}
    dec.graphs.calls.clear()
    serve(dec, PLAN)
    met = set(dec.graphs.calls)
    assert met and met <= warm, sorted(met - warm)


@pytest.mark.parametrize("kind", ["plain", "eagle3"])
def test_warmup_covers_groups_of_any_size_and_mixed_settings(target, kind):
    """Requests admitted several at a time (prefills of 1, 2 and 3 prompts: a row bucket each) with
    greedy, sampled and top-p settings beside each other meet only warmed graphs."""
    dec = make(target, kind)
    dec.warmup(plain_rows=4) if kind == "eagle3" else dec.warmup()
    warm = {k for k, c in dec.graphs.calls.items() if c >= 2}
    dec.graphs.calls.clear()
    mixed = (SamplingParams(), SamplingParams(temperature=0.7, seed=1), SamplingParams(temperature=1.0, top_p=0.9))
    serve(dec, PLAN + PLAN[::-1], group=3, settings=mixed)
    met = set(dec.graphs.calls)
    assert {k[1] for k in met if k[0] == "prefill"} >= {4}  # a group of 3 ran as a prefill of 4 rows
    assert met <= warm, sorted(met - warm)


def test_padded_prefill_changes_no_tokens(target):
    """Three prompts admitted together (a prefill of 4 rows, the last prompt twice) give each row
    the tokens it gets admitted alone."""
    prompts, n = [[5, 9, 2, 7], [3] * 20, [11, 4] * 9], 12
    dec = Decoder(target, 4, 300, graphs=False)
    toks = dec.admit([0, 1, 2], prompts)
    for _ in range(n):
        for r, new in enumerate(dec.step([1, 1, 1, 0])[:3]):
            toks[r] += new
    for r, p in enumerate(prompts):
        dec.free_all()
        alone = dec.admit([r], [p])[0]
        for _ in range(n):
            alone += dec.step([int(i == r) for i in range(4)])[r]
        assert alone == toks[r]
    assert int(dec.cache.lens[3]) == 0  # the padding wrote no row of its own


@pytest.mark.parametrize("rows", [3, 5])
def test_warmup_for_some_rows_covers_their_bucket(target, rows):
    """Warmed for batches of up to 3 (5) rows, a decoder of 8 has its graphs for the row bucket
    such a batch steps in, 4 (8), when that many requests run at once, and none for a larger one."""
    dec = make(target, "eagle3", batch=16)
    dec.warmup(rows=rows, plain_rows=4)
    warm = {k for k, c in dec.graphs.calls.items() if c >= 2}
    bucket = 4 if rows == 3 else 8
    assert {k[1] for k in warm if k[0] == "step"} == {b for b in (1, 2, 4, 8) if b <= bucket}
    dec.graphs.calls.clear()
    serve(dec, PLAN, at_most=rows)
    met = set(dec.graphs.calls)
    assert bucket in {k[1] for k in met if k[0] == "step"} and met <= warm, sorted(met - warm)


def test_warmup_changes_no_tokens(target):
    """A warmed-up decoder generates what a fresh one does."""
    prompts, n = [[5, 9, 2, 7], [3] * 20], 15
    outs = []
    for dec in (Decoder(target, 4, 300, graphs=False), make(target, "plain")):
        if isinstance(dec.graphs, Recording):
            assert dec.warmup() > 0
        toks = dec.admit([0, 1], prompts)
        while any(len(t) < n for t in toks):
            for r, new in enumerate(dec.step([n - len(t) for t in toks] + [0, 0])[:2]):
                toks[r] += new
        outs.append(toks)
    assert outs[0] == outs[1] and len(outs[0][0]) == n


def test_engine_warms_every_decoder_its_policy_can_choose(target, monkeypatch):
    """Speculation for batches of 1 (the default policy): the one decoder is warmed speculating for
    one row, and plain for every row bucket. The batches the engine starts later, speculating or
    plain, run on that same decoder."""
    from eaglet import Generator
    from eaglet.runtime import decoder as decoder_mod
    from eaglet.server import engine as engine_mod
    from eaglet.server.metrics import ServerMetrics
    from eaglet.server.policy import SpecPolicy

    monkeypatch.setattr(decoder_mod, "GraphRunner", lambda *a, **k: Recording())
    monkeypatch.setattr(engine_mod, "graphs_on", lambda g: True)
    sp = Speculator(SpecConfig("eagle3", steps=3), head=random_head(target.config))
    eng = engine_mod.Engine(Generator(target, None, sp), 4, 8, 300, ServerMetrics("warm"), SpecPolicy(sp, max_batch=1))
    assert eng.warmup() > 0
    assert set(eng.steps) == {"chain:3"}
    dec = eng.decoder()  # the one decoder every batch runs on, plain or speculating
    warm = lambda d: {k for k, n in d.graphs.calls.items() if n >= 2}  # noqa: E731
    # a drafter on the device, no observer: a speculation step is one graph (SpecStep.step)
    assert {k[1] for k in warm(dec) if k[0] == "step" and k[-2] == "spec"} == {1}
    assert not {k for k in warm(dec) if k[0] in ("draft", "verify", "accept")}
    assert {k[1] for k in warm(dec) if k[0] == "decode"} == {1, 2, 4}
    assert {k[-1] for k in warm(dec) if k[0] == "decode"} == {"g", "s", "f"}  # every sampling mode
    assert ("prefill", 1, 64, "plain") in warm(dec) and ("prefill", 1, 64, "spec") in warm(dec)
    assert ("prefill", 1, 256, "plain") in warm(dec)
    # prefills of several prompts: every row bucket of the batch plain, the speculating one's for one row
    assert {k[1] for k in warm(dec) if k[0] == "prefill" and k[-1] == "plain"} == {1, 2, 4}
    assert {k[1] for k in warm(dec) if k[0] == "prefill" and k[-1] == "spec"} == {1}
    # the batches the engine starts run on it, with the warmed steps: nothing new is made
    assert eng.step("chain:3") is eng.steps["chain:3"] and eng.step(None) is dec.plain and eng.decoder() is dec
