"""The cost model, the external-mode verdict, reading accept length from other engines' metrics,
and `eaglet compare`."""
import json

import pytest

from eaglet.cli import main
from eaglet.errors import InvalidInput
from eaglet.perf.compare import compare
from eaglet.perf.cost import Costs, chain_tau, tau_from_positions
from eaglet.perf.external import accept_length_from_metrics
from eaglet.perf.planner import external_verdict
from eaglet.perf.record import environment


def test_chain_tau_closed_form():
    assert chain_tau(0.0, 5) == 1.0
    assert chain_tau(1.0, 5) == 6.0
    alpha, g = 0.7, 4
    assert chain_tau(alpha, g) == pytest.approx(sum(alpha ** i for i in range(g + 1)))
    assert tau_from_positions([0.7, 0.49, 0.343], 2) == pytest.approx(2.19)
    with pytest.raises(ValueError):
        tau_from_positions([0.5], 2)


def test_verify_curve_interpolates_between_measurements():
    c = Costs(decode_ms=10, draft_ms=1, verify_ms={1: 10, 16: 11.5, 64: 15})
    assert c.verify(16) == 11.5
    assert c.verify(40) == pytest.approx(11.5 + 24 / 48 * 3.5)
    assert c.verify(128) == pytest.approx(15 + 64 * 3.5 / 48)  # extrapolates the last segment
    assert c.speedup(3.0, 4, 16) == pytest.approx(3 * 10 / (4 + 11.5))


def test_the_case_we_start_from_loses():
    """decode 12 ms, verify 30 ms for a 3-token chain, τ 2.1: at most 0.84x, whatever the drafter costs."""
    v = external_verdict(decode_ms=12, verify_ms=30, draft_ms=0.0, tau=2.1, steps=2)
    assert not v.pays
    assert v.speedup == pytest.approx(0.84) and v.ceiling == pytest.approx(0.84)
    assert v.break_even_tau == pytest.approx(2.5)  # accept length needed at a 30 ms verify
    assert v.break_even_verify_ms == pytest.approx(25.2)  # verify needed at τ 2.1
    with_draft = external_verdict(12, 30, 1.5, 2.1, 2)
    assert with_draft.speedup < 0.84 and with_draft.break_even_tau == pytest.approx(33 / 12)
    assert external_verdict(12, 14, 0.5, 3.5, 4).pays


def test_plan_cli_prints_verdict(capsys):
    assert main(["plan", "--decode-ms", "12", "--verify-ms", "30", "--accept-len", "2.1", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "speculation loses" in out and "0.84x" in out and "2.50" in out and "25.2 ms" in out
    assert main(["plan", "--decode-ms", "12", "--verify-ms", "30", "--accept-len", "2.1", "--steps", "2",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["pays"] is False
    assert main(["plan", "--decode-ms", "0", "--verify-ms", "30", "--accept-len", "2.1", "--steps", "2"]) == 1
    assert main(["plan", "--decode-ms", "12", "--verify-ms", "30", "--accept-len", "9", "--steps", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("eaglet: error:") for line in err)


SGLANG = """# HELP sglang:spec_accept_length The average acceptance length of speculative decoding.
# TYPE sglang:spec_accept_length gauge
sglang:spec_accept_length{model_name="m"} 2.9
"""
VLLM = """# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{model_name="m"} 200.0
# TYPE vllm:spec_decode_num_accepted_tokens counter
vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 310.0
"""


def test_accept_length_from_sglang_and_vllm_metrics():
    assert accept_length_from_metrics(SGLANG)[0] == pytest.approx(2.9)
    tau, source = accept_length_from_metrics(VLLM)
    assert tau == pytest.approx(1 + 310 / 200) and "vllm" in source
    with pytest.raises(InvalidInput):
        accept_length_from_metrics("# TYPE other gauge\nother 1\n")


def test_plan_reads_a_live_metrics_endpoint(capsys):
    import http.server
    import threading

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = VLLM.encode()
            self.send_response(200 if self.path == "/metrics" else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_port}"
        assert main(["plan", "--decode-ms", "12", "--verify-ms", "14", "--steps", "3", "--metrics-url", url]) == 0
        assert "2.55 read from" in capsys.readouterr().out
    finally:
        srv.shutdown()


def test_a_drafter_fingerprint_tells_stages_of_one_run_apart(tmp_path):
    """Two exports of one training run share config and file sizes; the record must still tell
    which one a figure came from, so a small directory's weights are hashed whole."""
    from eaglet.perf.record import path_fingerprint

    for name, byte in (("a", b"\x00"), ("b", b"\x01"), ("c", b"\x00")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle3"]}')
        (tmp_path / name / "model.safetensors").write_bytes(byte * 64)
    a, b, c = (path_fingerprint(tmp_path / n)["sha256-config-and-weights"] for n in "abc")
    assert a != b and a == c
    assert path_fingerprint(tmp_path / "a")["bytes"] == 64  # the weights' size, as a file's fingerprint has


def test_a_gpu_record_carries_the_process_peak_memory(tmp_path, monkeypatch):
    """Whether two jobs fit one GPU at once is read from their records: a process that used the
    GPU records its peak allocated and reserved memory; one that never did records none."""
    import torch

    from eaglet.perf import record as rec

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # a process that never touched a GPU
    path = rec.write_record("data", {}, {"n": 1}, tmp_path)
    assert "gpu_memory" not in json.loads(path.read_text())["results"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: 100.5 * 2**30)
    assert rec.gpu_peak_memory() == {"peak_allocated_gib": 3.0, "peak_reserved_gib": 100.5}


def record(flags: dict, env_extra: dict, tok_s: float) -> dict:
    env = environment()
    env["env"] = {**env["env"], **env_extra}
    return {"kind": "bench", "flags": flags, "environment": env, "models": {}, "results": {"tok_s": tok_s}}


def test_compare_names_one_flag_and_one_environment_variable(tmp_path, capsys):
    a = record({"spec_steps": 5, "eager": False}, {"NCCL_P2P_DISABLE": "0"}, 100.0)
    b = json.loads(json.dumps(a))
    b["flags"]["eager"] = True
    b["environment"]["env"]["NCCL_P2P_DISABLE"] = "1"
    b["results"]["tok_s"] = 80.0
    keys = [d[0] for d in compare(a, b)["differences"]]
    assert sorted(keys) == ["environment.env.NCCL_P2P_DISABLE", "flags.eager"]
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    assert main(["compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    assert "flags.eager: false -> true" in out and "NCCL_P2P_DISABLE" in out and "-20.0%" in out
    assert main(["compare", str(tmp_path / "a.json"), str(tmp_path / "nope.json")]) == 1
