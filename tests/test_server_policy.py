"""`eaglet serve`'s speculation policy (a profile's per-batch-size choice, --spec-max-batch): one
request speculates, a burst that starts together decodes plain, a speculating batch that grows
turns plain, bad policy flags give one error line."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import uvicorn

from eaglet.cli import main
from eaglet.config import SpecConfig
from eaglet.generate import Generator
from eaglet.server.engine import ADMIT_SHARE, ADMIT_WAIT
from eaglet.server.load import LoadMeter
from eaglet.server.policy import SpecPolicy, load_profile_policy
from eaglet.spec.speculator import Speculator

from .serving import PROMPTS, LiveServer, gate_steps, reference, speculator, wait_for

# ---- the speculation policy ---------------------------------------------------------------------

# An `eaglet profile` record's results, made up so that the planner speculates (chain:2) at batch 1
# and decodes plain at batch 4: verifying costs nothing extra alone and a lot in a batch of 4.
POLICY_PROFILE = {
    "costs": [{"batch": 1, "context": 64, "decode_ms": 10.0, "verify_ms": {"1": 10.0, "2": 10.0, "3": 10.0},
               "draft_ms": {"1": 0.5}},
              {"batch": 4, "context": 64, "decode_ms": 10.0, "verify_ms": {"1": 10.0, "2": 30.0, "3": 40.0},
               "draft_ms": {"1": 2.0}}],
    "acceptance": {"chain": {"steps": 2, "accept_per_pos": [0.8, 0.6], "accept_length": 2.4, "drafts": 100,
                             "step_ms_measured": 11.0}, "trees": {}},
    "acceptance_batch": 1,
}


def write_record(path, kind: str, results: dict):
    path.write_text(json.dumps({"kind": kind, "flags": {"spec": "eagle3"}, "environment": {}, "models": {},
                                "results": results}))
    return path


@pytest.fixture
def policy_record(tmp_path):
    return write_record(tmp_path / "profile.json", "profile", POLICY_PROFILE)


def serve_app(monkeypatch, flags: list[str]):
    """What `eaglet serve FLAGS` would hand to uvicorn.run: its app (the engine a thread in it, to look at)."""
    apps = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: apps.append(app))
    assert main(["serve", "--no-engine-process", *flags]) == 0
    return apps[0]


def test_the_profile_policy(policy_record):
    table, speedups, _ = load_profile_policy(str(policy_record))
    assert table == {1: "chain:2", 4: None}
    assert speedups[1]["chain:2"] > 1.0 > speedups[4]["chain:2"]  # the planner's predictions behind the table
    p = SpecPolicy(Speculator(SpecConfig("ngram", steps=3)), table)
    assert [p.choose(n) for n in (1, 2, 3, 4, 5, 16)] == ["chain:2"] * 3 + [None] * 3
    assert p.speculator("chain:2").spec == SpecConfig("ngram", steps=2) and p.speculator(None) is None
    assert [SpecPolicy(p.base, table, 2).choose(n) for n in (1, 2, 3)] == ["chain:2", "chain:2", None]
    assert [SpecPolicy(p.base, None, 2).choose(n) for n in (1, 2, 3)] == ["chain:3", "chain:3", None]
    assert SpecPolicy(p.base, None, 0).choose(1) is None and SpecPolicy(None).choose(1) is None
    assert [SpecPolicy(p.base, {2: "chain:1", 8: None}).choose(n) for n in (1, 7, 8)] == ["chain:1", "chain:1", None]


@pytest.mark.parametrize("mode", ["--spec-policy", "--spec-max-batch"])
def test_spec_policy_speculates_alone_and_serves_a_burst_plain(tiny, model_dir, drafter_dir, policy_record, mode,
                                                               monkeypatch, capsys, caplog):
    """`eaglet serve` with a profile's policy (chain:2 at 1, plain at 4) or --spec-max-batch 3: a
    request alone speculates; 4 greedy requests that join it at once turn the batch plain before
    they start (their usage has no accept length, the speculation counters do not move); greedy
    text is the same."""
    flags = ["--model", str(model_dir), "--device", "cpu", "--draft", str(drafter_dir), "--max-batch", "4",
             "--served-model-name", "tiny"]
    flags += ["--spec-policy", str(policy_record)] if mode == "--spec-policy" else ["--spec-steps", "2",
                                                                                    "--spec-max-batch", "3"]
    app = serve_app(monkeypatch, flags)
    assert ("(1: chain:2, 4: plain; a batch keeps its setting up to chain:2 3)" if mode == "--spec-policy"
            else "chain:2 for batches of up to 3, plain above") in capsys.readouterr().err
    gate = threading.Event()
    held = gate_steps(monkeypatch, gate, sampled_only=True)
    caplog.set_level("INFO", logger="eaglet.server")
    want = {p: reference(tiny, None, p, 16, chat=False) for p in PROMPTS[:4]}
    with LiveServer(None, app=app) as srv:
        c = srv.client()
        srv.engine.load.window = WINDOW  # the server's LOAD_WINDOW, shortened for the test

        def alone() -> None:
            m0 = srv.metrics()
            r = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16, temperature=0)
            assert r.choices[0].text == want[PROMPTS[0]]
            assert r.usage.accept_length is not None and r.usage.spec_decode["num_drafts"] >= 1
            m = srv.metrics()
            assert m["eaglet:spec_policy_speculating"] == 1 and m["eaglet:spec_policy_batch_size"] == 1
            assert m["eaglet:spec_policy_setting{setting=chain:2}"] == 1
            assert (m["eaglet:spec_decode_num_drafts_total"] - m0["eaglet:spec_decode_num_drafts_total"]
                    == r.usage.spec_decode["num_drafts"])

        alone()

        async def burst():
            """4 greedy requests queue while a seeded one is held in its step, then join it together."""
            async with srv.async_client() as ac:
                return await burst_with(ac)

        async def burst_with(ac):
            blocker = asyncio.ensure_future(ac.completions.create(model="tiny", prompt=PROMPTS[5], max_tokens=4,
                                                                  temperature=1.0, seed=1))
            assert await asyncio.to_thread(held.wait, 10)
            reqs = [asyncio.ensure_future(ac.completions.create(model="tiny", prompt=p, max_tokens=16,
                                                                temperature=0)) for p in PROMPTS[:4]]
            await asyncio.to_thread(wait_for, lambda: srv.metrics()["eaglet:num_requests_waiting"] == 4, 10)
            m0 = srv.metrics()
            gate.set()
            return m0, await blocker, await asyncio.gather(*reqs)

        m0, blocker, rs = asyncio.run(burst())
        assert [r.choices[0].text for r in rs] == [want[p] for p in PROMPTS[:4]]
        assert all(r.usage.accept_length is None and r.usage.spec_decode is None for r in rs)
        assert blocker.usage.accept_length is not None  # alone at first: speculated
        m = srv.metrics()
        assert (m["eaglet:spec_decode_num_drafts_total"] - m0["eaglet:spec_decode_num_drafts_total"]
                == blocker.usage.spec_decode["num_drafts"])  # the burst drafted nothing
        assert m["eaglet:spec_policy_speculating"] == 0 and m["eaglet:spec_policy_batch_size"] == 4
        assert m["eaglet:spec_policy_setting{setting=plain}"] == 1
        assert m["eaglet:spec_policy_setting{setting=chain:2}"] == 0
        time.sleep(WINDOW + 0.1)  # the policy remembers the burst's load this long
        alone()  # the next request alone speculates again
    assert "the speculating batch (chain:2) grows to 4 requests, a size the policy decodes plain" in caplog.text
    assert "a batch of 1 request starts speculating with chain:2 (was plain)" in caplog.text


def one_then_four(srv, held, gate):
    """PROMPTS[4] alone (its first step held at the gate), then PROMPTS[:4] queued behind it, then the gate
    opened: the completions (greedy, 12 tokens), the first and the other four."""
    async def go():
        async with srv.async_client() as ac:
            def send(p):
                return asyncio.ensure_future(ac.completions.create(model="tiny", prompt=p, max_tokens=12,
                                                                   temperature=0))
            first = send(PROMPTS[4])
            assert await asyncio.to_thread(held.wait, 10)
            rest = [send(p) for p in PROMPTS[:4]]
            await asyncio.to_thread(wait_for, lambda: srv.metrics()["eaglet:num_requests_waiting"] == 4, 10)
            gate.set()
            return await first, await asyncio.gather(*rest)

    return asyncio.run(go())


def test_a_speculating_batch_that_grows_turns_plain(tiny, drafter_dir, policy_record, monkeypatch, caplog):
    """One request starts a speculating batch; 4 more arrive (load 4: plain): the batch turns plain
    where it stands and takes in the 3 that fit at once (the 4th joins when a row frees). The first request speculated before the switch and
    decodes plain after it; every text is the greedy reference."""
    sp = speculator(tiny, drafter_dir, "eagle3")  # chain:3; the policy picks chain:2 at 1
    table, speedups, _ = load_profile_policy(str(policy_record))
    gate = threading.Event()
    held = gate_steps(monkeypatch, gate, sampled_only=False)
    caplog.set_level("INFO", logger="eaglet.server")
    want = {p: reference(tiny, None, p, 12, chat=False) for p in PROMPTS[:5]}
    with LiveServer(Generator(tiny.model, tiny.tokenizer, sp), max_batch=4,
                    policy=SpecPolicy(sp, table, None, "profile.json", speedups)) as srv:
        first, rest = one_then_four(srv, held, gate)
        assert first.choices[0].text == want[PROMPTS[4]] and first.usage.accept_length is not None
        assert [r.choices[0].text for r in rest] == [want[p] for p in PROMPTS[:4]]
        assert all(r.usage.accept_length is None for r in rest)
        m = srv.metrics()
        assert m["eaglet:spec_policy_speculating"] == 0 and m["eaglet:spec_policy_batch_size"] == 4
        assert first.usage.spec_decode["num_drafts"] == 1  # the step held at the gate; plain after it
        assert set(srv.engine.steps) == {"chain:2"}  # the steps of the settings chosen; one decoder
    assert "the speculating batch (chain:2) grows to 4 requests, a size the policy decodes plain: it turns plain" \
        in caplog.text
    assert "starts plain" not in caplog.text


@pytest.mark.parametrize("case", ["missing", "not json", "not a profile", "no costs", "no drafter", "negative cap",
                                  "negative keep", "switch without a profile"])
def test_spec_policy_flags_are_checked(tmp_path, case, capsys):
    """Each mistake is one `eaglet: error:` line, before any model is loaded."""
    path = {"missing": tmp_path / "nope.json",
            "not json": tmp_path / "bad.json",
            "not a profile": write_record(tmp_path / "bench.json", "bench", {"tok_s": 1.0}),
            "no costs": write_record(tmp_path / "p.json", "profile", {"acceptance": {}}),
            }.get(case, write_record(tmp_path / "ok.json", "profile", POLICY_PROFILE))
    if case == "not json":
        path.write_text("{not json")
    flags = ["serve", "--model", str(tmp_path / "no-model"), "--spec", "none" if case == "no drafter" else "ngram",
             "--spec-policy", str(path)] + {"negative cap": ["--spec-max-batch", "-1"],
                                            "negative keep": ["--spec-keep-over", "-0.5"]}.get(case, [])
    if case == "switch without a profile":
        flags = flags[:-2] + ["--spec-switch"]
    assert main(flags) == 1
    err = capsys.readouterr().err
    assert err.startswith("eaglet: error: ") and err.count("\n") == 1, err
    assert {"missing": "does not exist", "not json": "not JSON", "not a profile": "not a profile record",
            "no costs": "without the costs and acceptance", "no drafter": "none is configured",
            "negative cap": "--spec-max-batch must be >= 0", "negative keep": "--spec-keep-over must be >= 0",
            "switch without a profile": "--spec-switch moves a batch between the settings of a --spec-policy"}[case] in err


WINDOW = 1.0


def test_load_meter_keeps_the_peak_of_its_window():
    m = LoadMeter(window=2.0)
    assert m.peak(0.0) == 0
    for t, n in [(0.0, 1), (0.5, 16), (1.0, 3), (1.5, 0)]:
        m.note(n, t)
    assert m.peak(1.6) == 16  # closed-loop clients between batches: the burst is remembered
    assert m.peak(2.4) == 16
    assert m.peak(2.6) == 3  # the 16 left the window; the 3 at 1.0 is now the largest
    assert m.peak(3.2) == 0
    m.note(2, 4.0)
    assert m.peak(4.0) == 2


# The H200 ShareGPT profile's policy (bench/results/profile-gpu-20261130-225722.json), as a table.
SHAREGPT_POLICY = {1: "tree:4,4,16", 2: "tree:4,4,12", 4: "tree:4,4,16", 8: "tree:5,4,24", 16: "tree:4,4,12",
                   32: "tree:4,4,12", 64: "chain:4"}


def test_reach_is_the_largest_batch_a_setting_is_chosen_for():
    p = SpecPolicy(Speculator(SpecConfig("ngram", steps=3)), SHAREGPT_POLICY)
    assert [p.reach(s, 64) for s in ("tree:4,4,16", "tree:4,4,12", "tree:5,4,24", "chain:4", "chain:9")] \
        == [7, 63, 15, 64, 0]
    assert p.reach("tree:4,4,12", 16) == 16 and SpecPolicy(p.base, None, 3).reach("chain:3", 64) == 3


def sharegpt_speedups() -> dict[int, dict[str, float]]:
    """The committed H200 ShareGPT profile's predicted speedups, per batch size and setting."""
    from pathlib import Path

    _, speedups, _ = load_profile_policy(str(Path(__file__).parents[1] / "bench/results/profile-gpu-20261130-225722.json"))
    return speedups


def test_a_setting_reaches_on_while_the_profile_says_it_beats_plain():
    """With the profile's predictions a setting reaches past the sizes it is chosen for while it is
    predicted KEEP_OVER_PLAIN faster than plain at each: on the H200 ShareGPT profile every setting
    is 1.25-1.64x plain at 16-64 requests, so each reaches the whole batch (a batch that started
    alone keeps speculating under a steady load of 16 instead of turning plain for the load's life).
    A setting predicted below the margin at a size stops before it, and so does a size decoded plain."""
    from eaglet.server import KEEP_OVER_PLAIN

    base = Speculator(SpecConfig("ngram", steps=3))
    speedups = sharegpt_speedups()
    assert SpecPolicy(base, SHAREGPT_POLICY, speedups=speedups).choose(16) == "tree:4,4,12"
    assert all(speedups[b][s] >= KEEP_OVER_PLAIN for b in (16, 32, 64) for s in SHAREGPT_POLICY.values())
    p = SpecPolicy(base, SHAREGPT_POLICY, speedups=speedups)
    assert [p.reach(s, 64) for s in ("tree:4,4,16", "tree:4,4,12", "tree:5,4,24", "chain:4", "chain:9")] \
        == [64, 64, 64, 64, 0]
    weak = {b: dict(v) for b, v in speedups.items()}
    weak[32]["tree:4,4,16"] = KEEP_OVER_PLAIN - 0.01  # predicted too close to plain at 32-63 requests
    assert SpecPolicy(base, SHAREGPT_POLICY, speedups=weak).reach("tree:4,4,16", 64) == 31
    capped = SpecPolicy(base, SHAREGPT_POLICY, 24, speedups=speedups)  # --spec-max-batch 24: plain above
    assert capped.reach("tree:4,4,16", 64) == 24 and not capped.keeps("tree:4,4,16", 25)
    strict = SpecPolicy(base, SHAREGPT_POLICY, speedups=speedups, keep_over=1.55)  # 1.54x and 1.52x at 16
    assert [strict.reach(s, 64) for s in ("tree:4,4,16", "tree:5,4,24")] == [15, 15]
    off = SpecPolicy(base, SHAREGPT_POLICY, speedups=speedups, keep_over=0)  # --spec-keep-over 0: the sizes chosen
    assert [off.reach(s, 64) for s in ("tree:4,4,16", "tree:4,4,12", "tree:5,4,24")] == [7, 63, 15]
    assert p.describe(64).endswith("; a batch keeps its setting up to tree:4,4,16 64, tree:4,4,12 64, tree:5,4,24 64, "
                                   "chain:4 64)")
    assert off.describe(16).endswith("up to tree:4,4,16 7, tree:4,4,12 16, tree:5,4,24 15)")  # chain:4: not at 16


@pytest.mark.parametrize("joining, plain, predicted", [(6, False, False), (7, True, False), (15, False, True)])
def test_a_batch_grown_past_its_settings_reach_turns_plain(joining, plain, predicted):
    """A batch that started speculating with tree 4,4,16 (chosen for 1 and 4-7 requests) keeps it
    while it grows to 7 requests (tree 4,4,12 is chosen at 2: still within its reach, and warmed),
    and without the profile's predictions turns plain when it would hold 8 (the policy chose tree
    5,4,24 there; the engine does not run a setting at a size it was not chosen, nor warmed, for).
    With the profile's predictions (`predicted`) it keeps speculating at 16 requests: its reach is
    the whole batch."""
    from collections import deque

    from eaglet.sampling import SamplingParams
    from eaglet.server.engine import Engine, Request
    from eaglet.server.metrics import ServerMetrics

    class Gen:
        speculator = Speculator(SpecConfig("eagle3", steps=4, topk=4, draft_tokens=16))

    class Running:
        sampling, running, speculative = SamplingParams(), 1, True
        free_rows = list(range(1, 64))

    eng = Engine(Gen(), 64, 256, 512, ServerMetrics("reach"),
                 SpecPolicy(Gen.speculator, SHAREGPT_POLICY, speedups=sharegpt_speedups() if predicted else None))
    eng.batcher, eng.setting, eng.chosen = Running(), "tree:4,4,16", True
    eng.waiting = deque(Request([1, 2], 4, SamplingParams()) for _ in range(joining))
    new, admit, setting, n = eng.next_admission()
    assert not new and len(admit) == joining and not eng.waiting  # they join the running batch
    assert (eng.switch, eng.setting) == ((True, None) if plain else (False, "tree:4,4,16"))


@pytest.mark.parametrize("running, free, waiting, age, admitted", [
    (56, 8, 6, 0.0, 0),  # 6 of the 7 (56 / ADMIT_SHARE) a group needs: they wait
    (56, 8, 7, 0.0, 7),  # a group
    (60, 4, 6, 0.0, 4),  # a group as large as the free rows
    (56, 8, 2, ADMIT_WAIT + 0.01, 2),  # the oldest has waited long enough
    (8, 56, 1, 0.0, 1),  # a batch of up to ADMIT_SHARE rows takes each at once
])
def test_a_running_batch_admits_in_groups(running, free, waiting, age, admitted):
    """Requests joining a running batch are admitted together, one prefill for several, once enough
    wait (1/ADMIT_SHARE of the running rows, at most the free ones) or the oldest waited ADMIT_WAIT."""
    from collections import deque

    from eaglet.sampling import SamplingParams
    from eaglet.server.engine import Engine, Request
    from eaglet.server.metrics import ServerMetrics

    class Gen:
        speculator = None

    class Running:
        sampling, speculative = SamplingParams(), False

    Running.running, Running.free_rows = running, list(range(running, running + free))
    eng = Engine(Gen(), 64, 256, 512, ServerMetrics("groups"), SpecPolicy(None))
    eng.batcher, eng.setting, eng.chosen = Running(), None, True
    now = time.perf_counter()
    eng.waiting = deque(Request([1, 2], 4, SamplingParams(), arrival=now - age) for _ in range(waiting))
    new, admit, setting, n = eng.next_admission()
    assert not new and len(admit) == admitted and len(eng.waiting) == waiting - admitted
    # the step before an admission that comes next is one step, not a trip (its prefill waits for
    # the steps in flight): after a group is taken, the rest wait for the next group
    assert not eng.admits_next(len(admit)) or len(eng.waiting) * ADMIT_SHARE >= running + len(admit)
    eng.waiting = deque([Request([1, 2], 4, SamplingParams(), arrival=now - ADMIT_WAIT)])
    assert eng.admits_next(0) == (free > 0)  # a request that has waited long is admitted next


def test_one_cache_for_the_servers_life(tiny, drafter_dir, monkeypatch):
    """Requests that change temperature, top-p, seed and load (alone: speculating; several at once:
    plain) are served from the caches made for the first batch: the target's and the drafter's,
    allocated once, whatever the mix (before, each sampling setting and each plain/speculative
    choice had a decoder, and a cache, of its own)."""
    import eaglet.kvcache as kvcache

    made = []
    init = kvcache.KVCache.__init__
    monkeypatch.setattr(kvcache.KVCache, "__init__", lambda self, *a, **k: made.append(a[1]) or init(self, *a, **k))
    sp = speculator(tiny, drafter_dir, "eagle3")
    with LiveServer(Generator(tiny.model, tiny.tokenizer, sp), max_batch=4, policy=SpecPolicy(sp, max_batch=1)) as srv:
        c = srv.client()
        settings = [dict(temperature=0), dict(temperature=0.5), dict(temperature=0.3, top_p=0.9), dict(temperature=0),
                    dict(temperature=0.9, seed=4)]
        for kw in settings:
            c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6, **kw)
        assert made == [4, 4]  # the target's cache and the drafter's, 4 rows each

        async def burst():
            ac = srv.async_client()
            return await asyncio.gather(*(ac.completions.create(model="tiny", prompt=p, max_tokens=6, **kw)
                                          for p, kw in zip(PROMPTS[:4] * 2, settings * 2)))
        rs = asyncio.run(burst())
        assert len(rs) == 8 and srv.metrics()["eaglet:spec_policy_speculating"] == 0  # the load went plain
        for kw in settings:
            c.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=6, **kw)
    assert made == [4, 4]


# as POLICY_PROFILE, but a batch of 4 verifies two tokens cheaply: chain:2 alone, chain:1 at 4 requests
SWITCH_PROFILE = {**POLICY_PROFILE, "costs": [
    POLICY_PROFILE["costs"][0],
    {"batch": 4, "context": 64, "decode_ms": 10.0, "verify_ms": {"1": 10.0, "2": 11.0, "3": 40.0}, "draft_ms": {"1": 2.0}}]}


def test_a_growing_batch_moves_to_the_setting_of_its_size(tiny, drafter_dir, tmp_path, monkeypatch, caplog):
    """--spec-switch: one request starts a batch speculating with chain:2; 4 more arrive (load 4:
    chain:1), and the batch moves to chain:1 where it stands, no prefill, the drafter the same
    (made as wide as chain:2). Every text is the greedy reference, and the first request's draft
    counters span both settings."""
    sp = speculator(tiny, drafter_dir, "eagle3")
    table, speedups, _ = load_profile_policy(str(write_record(tmp_path / "p.json", "profile", SWITCH_PROFILE)))
    assert (table[1], table[4]) == ("chain:2", "chain:1")
    gate = threading.Event()
    held = gate_steps(monkeypatch, gate, sampled_only=False)
    caplog.set_level("INFO", logger="eaglet.server")
    want = {p: reference(tiny, None, p, 12, chat=False) for p in PROMPTS[:5]}
    policy = SpecPolicy(sp, table, None, "p.json", speedups, switch=True)
    with LiveServer(Generator(tiny.model, tiny.tokenizer, sp), max_batch=4, policy=policy) as srv:
        first, rest = one_then_four(srv, held, gate)
        assert first.choices[0].text == want[PROMPTS[4]]
        assert [r.choices[0].text for r in rest] == [want[p] for p in PROMPTS[:4]]
        assert first.usage.spec_decode["num_drafts"] > 1  # chain:2's held step, then chain:1's
        assert all(r.usage.accept_length is not None for r in rest)  # they speculated too
        steps = srv.engine.steps
        assert set(steps) == {"chain:2", "chain:1"}
        a, b = steps["chain:2"], steps["chain:1"]
        assert a.drafter.cache is b.drafter.cache and a.counters is b.counters
        assert b.drafter.pend_ids.data_ptr() == a.drafter.pend_ids.data_ptr() and a.drafter.pend_ids.shape[1] == 3
        assert srv.metrics()["eaglet:spec_policy_speculating"] == 1
    assert "the speculating batch (chain:2) grows to 4 requests: it moves to chain:1" in caplog.text
    assert "turns plain" not in caplog.text


def test_with_switch_a_batch_moves_only_for_a_predicted_gain():
    """--spec-switch on the H200 ShareGPT profile: the settings lie within 2% of each other at 2-32
    requests, so a batch keeps its own there; at 64 chain:4 is predicted 1.08x tree 4,4,16 (it
    moves) and 1.04x tree 4,4,12 (it stays, under MOVE_OVER). Without predictions it moves to
    whatever is chosen; a size decoded plain is never a move."""
    from eaglet.server import MOVE_OVER

    base = Speculator(SpecConfig("ngram", steps=3))
    p = SpecPolicy(base, SHAREGPT_POLICY, speedups=sharegpt_speedups(), switch=True)
    assert [p.move("tree:4,4,16", n) for n in (2, 8, 16, 32, 63, 64)] == [None] * 5 + ["chain:4"]
    assert p.move("tree:4,4,12", 64) is None  # 1.511 / 1.448 = 1.043: under MOVE_OVER
    assert p.move("chain:4", 4) == "tree:4,4,16"  # 1.698 / 1.510 = 1.12
    assert MOVE_OVER == 1.05
    assert [p.reach(s, 64) for s in ("tree:4,4,16", "tree:4,4,12", "tree:5,4,24", "chain:4")] == [63, 64, 63, 64]
    bare = SpecPolicy(base, SHAREGPT_POLICY, switch=True)  # no predictions: the choice at each size
    assert [bare.move("tree:4,4,16", n) for n in (1, 2, 8, 64)] == [None, "tree:4,4,12", "tree:5,4,24", "chain:4"]
    assert SpecPolicy(base, {1: "chain:2", 4: None}, switch=True).move("chain:2", 4) is None
    assert p.describe(64).endswith("chain:4 64; a growing batch moves to its size's setting where predicted 1.05x its own)")
