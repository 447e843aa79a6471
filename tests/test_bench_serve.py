"""`eaglet bench-serve` against a live tiny `eaglet serve` (n-gram speculation): fixed concurrency
and Poisson arrivals, chat and completions; its JSON record (counts, latencies, accept length);
failures counted and reflected in the exit status; the accept length from /metrics counters of
vLLM and eaglet; prompts from a ShareGPT file cut off mid-record."""
import json
import time

import pytest

from eaglet.cli import main
from eaglet.config import SpecConfig
from eaglet.generate import Generator
from eaglet.perf.bench_serve import (accept_length, engine_time, load_bench_prompts, server_metrics,
                                     server_ttft_ms)
from eaglet.spec.speculator import load_speculator

from .serving import PROMPTS, LiveServer


@pytest.fixture(scope="module")
def server(tiny):  # noqa: F811
    sp = load_speculator(SpecConfig("ngram", steps=3), tiny.model, tiny.path)
    with LiveServer(Generator(tiny.model, tiny.tokenizer, sp), max_batch=8) as srv:
        yield srv


@pytest.fixture
def prompts_file(tmp_path):
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return f


def record(out_dir) -> dict:
    [f] = list(out_dir.glob("bench-serve-*.json"))
    return json.loads(f.read_text())


def run(capsys, *argv) -> tuple[int, str]:
    rc = main(["bench-serve", "--no-progress", *argv])
    return rc, capsys.readouterr().out


def test_fixed_concurrency_chat(server, prompts_file, tmp_path, capsys):
    time.sleep(0.5)  # the engine waits a moment before the run: not the run's time
    rc, out = run(capsys, "--url", server.url, "--prompts", str(prompts_file), "--num-requests", "40",
                  "--concurrency", "8", "--max-tokens", "8", "--ignore-eos", "--out", str(tmp_path))
    assert rc == 0, out
    rec = record(tmp_path)
    r = rec["results"]
    assert rec["kind"] == "bench-serve" and r["server"]["model"] == "tiny"  # found at /v1/models
    assert r["completed"] == 40 and r["failed"] == 0 and r["output_tokens"] == 40 * 8
    assert r["prompt_tokens"] > 0 and r["request_throughput"] > 0 and r["output_throughput"] > 0
    for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert 0 < r[k]["median"] <= r[k]["p99"]
    assert r["accept_length"] >= 1 and r["accept_length_source"].startswith("usage")
    after = r["server"]["metrics_after"]
    assert after["eaglet:spec_decode_num_drafts"] > r["server"]["metrics_before"]["eaglet:spec_decode_num_drafts"]
    assert after["process_resident_memory_bytes"] > 0 and after["eaglet:kv_cache_total_tokens"] > 0
    for line in ("TTFT (ms)", "TPOT (ms)", "ITL (ms)", "accept length", "40 ok, 0 failed", "server TTFT"):
        assert line in out
    # the server's own TTFT (its histogram over these 40) is part of the client's
    assert 0 < r["server_ttft_ms"] < r["ttft_ms"]["mean"]
    assert r["client_event_loop"] in ("uvloop", "asyncio")
    # the engine thread's time over the run: its parts add up to its share of the wall, every step
    # (at most one an iteration) counted; on the CPU nothing waits on a device
    eng = r["engine"]
    assert eng["steps"] >= 40 * 8 / 4 / 8  # 8 rows at a time, at most 4 tokens a step (n-gram, 3 steps)
    assert sum(eng["share"][p] for p in ("idle", "admit", "step", "output", "other")) == pytest.approx(1.0)
    # between the two scrapes only: the engine's wait before the run was counted at the first
    assert sum(eng["seconds"][p] for p in ("idle", "admit", "step", "output", "other")) < r["duration_s"] + 0.25
    assert eng["seconds"]["step"] > 0 and eng["seconds"]["admit"] > 0 and eng["seconds"]["device_wait"] == 0
    assert 1 <= eng["admissions"] <= 40 and eng["admission_ms"] > 0  # 40 requests, one or more a prefill
    assert eng["per_step_ms"]["busy"] > 0 and eng["per_step_ms"]["host"] == pytest.approx(eng["per_step_ms"]["busy"])
    assert "engine step" in out and "waiting on the device" in out
    # the process's garbage-collection pauses over the run, per generation (often none in 40 tiny requests)
    assert set(eng["gc_seconds"]) == {"0", "1", "2"} and all(t >= 0 for t in eng["gc_seconds"].values())
    assert "gc pauses" in out
    # the requests summarised in the record (no per-request log): counts, and token and time spreads
    q = r["requests"]
    assert q["count"] == 40 and q["completed"] == 40 and q["failed"] == 0
    assert f"of the {q['drafted']} requests that drafted" in r["accept_length_source"]
    assert q["output_tokens"]["min"] == q["output_tokens"]["max"] == 8  # --ignore-eos: every reply is whole
    assert q["output_tokens"]["mean"] * 40 == r["output_tokens"]
    assert q["prompt_tokens"]["mean"] * 40 == pytest.approx(r["prompt_tokens"])
    for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = r[k]
        assert s["min"] <= s["p50"] == s["median"] <= s["p90"] <= s["p99"] <= s["max"]
        assert s["min"] <= s["mean"] <= s["max"]
    assert r["ttft_ms"]["max"] <= r["e2e_ms"]["max"]  # a request's first text comes before its end
    assert not list(tmp_path.glob("*.gz"))  # nothing written beside the record


def test_poisson_arrivals_completions(server, prompts_file, tmp_path, capsys):
    rc, out = run(capsys, "--url", server.url + "/v1", "--model", "tiny", "--endpoint", "completions",
                  "--prompts", str(prompts_file), "--num-requests", "20", "--request-rate", "100", "--max-tokens", "6",
                  "--out", str(tmp_path))
    assert rc == 0, out
    r = record(tmp_path)["results"]
    assert r["completed"] == 20 and r["failed"] == 0 and "rate=100.0/s" in out


def test_failures_are_counted(server, prompts_file, tmp_path, capsys):
    rc, _ = run(capsys, "--url", server.url, "--model", "not-served", "--prompts", str(prompts_file),
                  "--num-requests", "5", "--concurrency", "2", "--max-tokens", "4", "--out", str(tmp_path))
    r = record(tmp_path)["results"]
    assert rc == 1 and r["completed"] == 0 and r["failed"] == 5
    assert r["requests"]["count"] == 5 and r["requests"]["failed"] == 5 and r["requests"]["drafted"] == 0
    assert any("HTTP 404" in e and "does not exist" in e for e in r["errors"])


def test_unreachable_server_is_one_error_line(capsys, tmp_path):
    assert main(["bench-serve", "--url", "http://127.0.0.1:9", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("eaglet: error: cannot list the models") and len(err.strip().splitlines()) == 1


def test_accept_length_from_server_counters():
    before = server_metrics("vllm:spec_decode_num_drafts_total{model_name=\"m\"} 10\n"
                           "vllm:spec_decode_num_accepted_tokens_total{model_name=\"m\"} 5\n")
    after = server_metrics("vllm:spec_decode_num_drafts_total{model_name=\"m\"} 30\n"
                          "vllm:spec_decode_num_accepted_tokens_total{model_name=\"m\"} 35\n")
    tau, source = accept_length([], before, after)  # no request reported its drafts
    assert tau == pytest.approx(1 + 30 / 20) and "vllm" in source
    tau, source = accept_length([], {}, server_metrics("sglang:spec_accept_length 2.5\n"))
    assert tau == 2.5 and "sglang" in source
    assert accept_length([], None, None) == (None, "not reported")


def test_server_ttft_from_histograms():
    """The server's mean TTFT over a run from its histogram's sum and count (any server's prefix)."""
    before = server_metrics('vllm:time_to_first_token_seconds_sum{model_name="m"} 1.0\n'
                            'vllm:time_to_first_token_seconds_count{model_name="m"} 10\n')
    after = server_metrics('vllm:time_to_first_token_seconds_sum{model_name="m"} 1.5\n'
                           'vllm:time_to_first_token_seconds_count{model_name="m"} 20\n'
                           'vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 20\n')
    assert server_ttft_ms(before, after) == pytest.approx(50.0)
    assert server_ttft_ms(before, before) is None and server_ttft_ms(None, after) is None
    assert server_ttft_ms({}, server_metrics("sglang:spec_accept_length 2.5\n")) is None


def test_engine_time_from_counters():
    """The engine's split of a run from its counters' deltas: shares of the wall time, per step the
    busy time less the device waits (the host's work), and the time of an admission."""
    def text(idle, admit, step, wait, steps, admissions):
        parts = (("idle", idle), ("admit", admit), ("step", step), ("output", 0.25), ("other", 0.25),
                 ("device_wait", wait))
        return "".join(f'eaglet:engine_seconds_total{{model_name="m",part="{p}"}} {v}\n' for p, v in parts) \
            + f'eaglet:engine_steps_total{{model_name="m"}} {steps}\n' \
            + f'eaglet:engine_admissions_total{{model_name="m"}} {admissions}\n'
    before, after = server_metrics(text(1.0, 0.5, 2.0, 0.5, 100, 5)), server_metrics(text(2.0, 0.7, 4.8, 1.5, 1100, 15))
    eng = engine_time(before, after)
    assert eng["seconds"] == pytest.approx({"idle": 1.0, "admit": 0.2, "step": 2.8, "output": 0.0, "other": 0.0,
                                            "device_wait": 1.0})
    assert eng["share"]["step"] == pytest.approx(0.7) and eng["share"]["device_wait"] == pytest.approx(0.25)
    assert eng["steps"] == 1000 and eng["per_step_ms"] == pytest.approx({"busy": 3.0, "host": 2.0, "device_wait": 1.0})
    assert eng["admissions"] == 10 and eng["admission_ms"] == pytest.approx(20.0)
    assert "gc_seconds" not in eng  # a server without the gc counter
    gc = lambda t: "".join(f'eaglet:gc_pause_seconds_total{{generation="{g}"}} {t * (g + 1)}\n' for g in range(3))  # noqa: E731
    eng = engine_time(server_metrics(text(1.0, 0.5, 2.0, 0.5, 100, 5) + gc(0.1)),
                      server_metrics(text(2.0, 0.7, 4.8, 1.5, 1100, 15) + gc(0.3)))
    assert eng["gc_seconds"] == pytest.approx({"0": 0.2, "1": 0.4, "2": 0.6})
    assert "graphs_captured" not in eng  # a server without the gauge
    graphs = lambda n: f'eaglet:cuda_graphs_captured{{model_name="m"}} {n}\n'  # noqa: E731
    eng = engine_time(server_metrics(text(1.0, 0.5, 2.0, 0.5, 100, 5) + graphs(921)),
                      server_metrics(text(2.0, 0.7, 4.8, 1.5, 1100, 15) + graphs(924)))
    assert eng["graphs_captured"] == 3  # captured while the run went on
    assert engine_time(before, before) is None and engine_time(None, after) is None
    assert engine_time({}, server_metrics("vllm:spec_decode_num_drafts_total 3\n")) is None  # not eaglet


def test_server_counts_gc_pauses_and_froze_its_startup_objects(server):
    """`eaglet serve` moves what it holds after warm-up out of the collector's sight (gc.freeze), and
    /metrics counts the time every collection stopped the process, per generation."""
    import gc

    assert gc.get_freeze_count() > 10000  # the model, tokenizer and libraries of this process
    before = server.metrics()
    gc.collect()  # a full collection: generation 2
    after = server.metrics()
    key = "eaglet:gc_pause_seconds_total{generation=2}"
    assert after[key] > before[key] >= 0
    assert after["eaglet:gc_pause_seconds_total{generation=0}"] >= before["eaglet:gc_pause_seconds_total{generation=0}"]


def test_sharegpt_file_prompts(tmp_path):
    convs = [{"conversations": [{"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": "a"}]}
             for i in range(3)] + [{"conversations": [{"from": "human", "value": "x" * 5000}]}]
    text = json.dumps(convs)
    f = tmp_path / "sg.json"
    f.write_text(text[:-40])  # cut off inside the last record, as the packaged file is
    got = load_bench_prompts(str(f), 7, max_chars=2000, seed=0)
    assert len(got) == 7 and set(got) == {"question 0", "question 1", "question 2"}


def test_the_key_is_sent_and_never_recorded(tiny, prompts_file, tmp_path, capsys, monkeypatch):
    """Against a server with --api-key: without the key every request fails (401); with it (flag or
    EAGLET_API_KEY) all succeed, and the record holds neither the key nor the variable's value."""
    with LiveServer(Generator(tiny.model, tiny.tokenizer), api_key="k-123") as srv:
        args = ["--url", srv.url, "--model", "tiny", "--prompts", str(prompts_file), "--num-requests", "4",
                "--concurrency", "2", "--max-tokens", "2"]
        rc, _ = run(capsys, *args, "--out", str(tmp_path / "none"))
        assert rc != 0 and record(tmp_path / "none")["results"]["failed"] == 4
        rc, out = run(capsys, *args, "--api-key", "k-123", "--out", str(tmp_path / "flag"))
        assert rc == 0, out
        rec = next((tmp_path / "flag").glob("bench-serve-*.json")).read_text()
        assert json.loads(rec)["results"]["completed"] == 4 and "k-123" not in rec
        monkeypatch.setenv("EAGLET_API_KEY", "k-123")
        rc, out = run(capsys, *args, "--out", str(tmp_path / "env"))
        assert rc == 0, out
        rec = json.loads(next((tmp_path / "env").glob("bench-serve-*.json")).read_text())
        assert rec["results"]["completed"] == 4 and "k-123" not in json.dumps(rec)
        assert rec["environment"]["env"]["EAGLET_API_KEY"] == "<redacted>"


def test_mixed_settings_run(server, prompts_file, tmp_path, capsys):
    """--mix: every request its own temperature, top-p/top-k, seed, max_tokens and streaming; all
    complete against one batch; the record counts the mix and the server's memory is reported."""
    from eaglet.perf.bench_serve import mixed_settings

    mix = mixed_settings(400, 0, hi=512)
    assert {d["temperature"] for d in mix} == {0.0, 0.3, 0.7, 1.0}
    assert 0.15 < sum("seed" in d for d in mix) / 400 < 0.35 and 0.35 < sum(d["stream"] for d in mix) / 400 < 0.65
    assert all(16 <= d["max_tokens"] <= 512 for d in mix) and any("top_k" in d for d in mix)
    assert not any("top_p" in d or "top_k" in d for d in mix if d["temperature"] == 0)
    same = mixed_settings(400, 0, hi=512, greedy=True)
    assert [(d["max_tokens"], d["stream"]) for d in same] == [(d["max_tokens"], d["stream"]) for d in mix]
    assert all(d.keys() == {"temperature", "max_tokens", "stream"} and d["temperature"] == 0 for d in same)
    rc, out = run(capsys, "--url", server.url, "--prompts", str(prompts_file), "--num-requests", "24",
                  "--concurrency", "8", "--mix", "--max-tokens", "100", "--endpoint", "completions",
                  "--check-seeded", "3", "--out", str(tmp_path))
    assert rc == 0, out
    r = record(tmp_path)["results"]
    # sent again alone each seeded request gets the text it got among seven others
    assert r["seeded_check"] == {"checked": 3, "differ": []} and "3 of 3 seeded requests" in out
    asked = mixed_settings(24, 0, hi=100)
    assert r["completed"] == 24 and r["mix"]["streamed"] == sum(d["stream"] for d in asked)
    assert r["mix"]["max_tokens"] == sum(d["max_tokens"] for d in asked) >= r["output_tokens"] > 0
    assert 0 < r["mix"]["streamed"] < 24 and 0 < r["ttft_ms"]["median"] <= r["e2e_ms"]["max"]
    assert "server memory" in out and "mixed settings" in out


def test_check_seeded_fails_when_seeds_do_not_hold(server, prompts_file, tmp_path, capsys, monkeypatch):
    """--check-seeded notices a server whose seeded text changes from one send to the next (here:
    every request a fresh random stream, its seed ignored): exit status 1 and the requests named."""
    from eaglet.sampling import SamplingParams, _fresh

    monkeypatch.setattr(SamplingParams, "stream", lambda self, index=0: _fresh.getrandbits(62))
    rc, out = run(capsys, "--url", server.url, "--prompts", str(prompts_file), "--num-requests", "12",
                  "--concurrency", "4", "--mix", "--max-tokens", "40", "--endpoint", "completions",
                  "--check-seeded", "3", "--out", str(tmp_path))
    chk = record(tmp_path)["results"]["seeded_check"]
    assert rc == 1 and chk["checked"] >= 2 and chk["differ"], out  # (a greedy seeded request still repeats)
