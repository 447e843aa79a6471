"""`eaglet bench-comm` on two gloo workers: a record and a plot, a positive finite latency per size
with the bandwidths nccl-tests would report, no graph column faked on CPUs, the requested NCCL
settings in every rank's environment at communicator creation; bad input as one error line; and
the planner's curve read back and interpolated log-log."""
import json
import math

import pytest

from eaglet.cli import main
from eaglet.dist.comm_curve import load_curve
from eaglet.errors import InvalidInput


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    """One run: 1 KiB and 64 KiB, plus the messages of 1 and 4 tokens of hidden 64 in float32 (256
    bytes, and 1 KiB again: that row carries T = 4)."""
    out = tmp_path_factory.mktemp("bench-comm")
    argv = ["bench-comm", "--tp", "2", "--device", "cpu", "--sizes", "1024", "65536", "--hidden", "64",
            "--tokens", "1", "4", "--repeats", "5", "--warmup", "2", "--nccl-env", "NCCL_PROTO=LL", "--out", str(out)]
    assert main(argv) == 0
    [path] = out.glob("bench-comm-cpu-*.json")
    return path, json.loads(path.read_text())


def test_record_rows_and_plot(record):
    path, rec = record
    assert rec["kind"] == "bench-comm" and rec["flags"]["tp"] == 2 and rec["environment"]["torch"]
    res = rec["results"]
    assert (res["world"], res["backend"], res["dtype"]) == (2, "gloo", "float32")
    assert [(r["bytes"], r["tokens"]) for r in res["rows"]] == [(256, 1), (1024, 4), (65536, None)]
    assert path.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert res["env_at_creation"] == [{"NCCL_PROTO": "LL"}] * 2 and res["nccl_requested"] == {"NCCL_PROTO": "LL"}


def test_latency_positive_max_over_ranks_and_bus_bandwidth(record):
    for r in record[1]["results"]["rows"]:
        per_rank = r["eager_us_per_rank"]
        assert len(per_rank) == 2 and all(math.isfinite(t) and t > 0 for t in per_rank)
        assert r["eager_us"] == max(per_rank)
        assert r["eager_algbw_gbps"] == pytest.approx(r["bytes"] / (r["eager_us"] * 1e-6) / 1e9)
        assert r["eager_busbw_gbps"] == pytest.approx(r["eager_algbw_gbps"] * 2 * (2 - 1) / 2)


def test_no_graph_column_on_cpus(record):
    res = record[1]["results"]
    assert res["graph_ops"] is None and "no CUDA graphs" in res["graph_note"]
    for r in res["rows"]:
        assert r["graph_us"] is None and r["graph_us_per_rank"] is None and r["graph_busbw_gbps"] is None
    with pytest.raises(InvalidInput, match="no graph_us latencies"):
        load_curve(record[0], graph=True)
    assert load_curve(record[0]).bytes == (256, 1024, 65536)


@pytest.mark.parametrize("flags, said", [
    (["--tp", "0"], "--tp 0"),
    (["--sizes", "0"], "--sizes 0"),
    (["--sizes", "1022"], "multiple of 4 bytes"),
    (["--nccl-env", "NCCL_PROTO"], "expected KEY=VALUE"),
    (["--tokens", "4"], "--tokens needs --hidden"),
    (["--shape", "no-such-model"], "--shape no-such-model: unknown"),
])
def test_bad_input_is_one_error_line(flags, said, capsys, tmp_path):
    assert main(["bench-comm", "--device", "cpu", "--out", str(tmp_path), *flags]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("eaglet: error:") and said in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())  # nothing written


def test_curve_interpolates_log_log(tmp_path):
    """Between 1 KiB at 10 µs and 4 KiB at 40 µs the log-log line is latency ∝ bytes: 2 KiB takes 20 µs;
    below the first point the first latency, past the last the last point's bandwidth."""
    rows = [{"bytes": 4096, "eager_us": 40.0, "graph_us": 8.0}, {"bytes": 1024, "eager_us": 10.0, "graph_us": 4.0}]
    path = tmp_path / "rec.json"
    path.write_text(json.dumps({"kind": "bench-comm", "results": {"world": 2, "backend": "nccl", "rows": rows}}))
    eager = load_curve(path)
    assert eager.bytes == (1024, 4096) and eager.world == 2
    assert eager.latency_us(2048) == pytest.approx(20.0)
    assert eager.latency_us(1024) == 10.0 and eager.latency_us(4096) == 40.0
    assert eager.latency_us(10) == 10.0 and eager.latency_us(8192) == pytest.approx(80.0)
    graph = load_curve(path, graph=True)  # 4 -> 8 µs over 4x the bytes: x sqrt(2) at 2 KiB
    assert graph.latency_us(2048) == pytest.approx(4.0 * math.sqrt(2))
    path.write_text(json.dumps({"kind": "bench-moe", "results": {}}))
    with pytest.raises(InvalidInput, match="not a bench-comm record"):
        load_curve(path)
