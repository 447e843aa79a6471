"""The deployment planner (perf/step_model.py, perf/plan_deploy.py, perf/diagnosis.py): the bytes and
all-reduces of a step on N GPUs, the case we start from (Kimi-K2.5 on 8 PCIe GPUs, speculation
losing) and a published deployment of the same family that won."""
import json

import pytest
import torch

from eaglet.cli import main
from eaglet.models.llama import CausalLM
from eaglet.perf.hardware import DEFAULT_EFFICIENCY, GPUS, LINKS
from eaglet.perf.shapes import RELEASED, SHAPES, decode_bytes, touched_experts
from eaglet.perf.step_model import Deployment, bytes_per_param, distinct_experts, step_bytes, step_time

KIMI = ["plan", "--shape", "kimi-k2.5", "--tp", "8", "--gpu", "rtx-pro-6000", "--link", "pcie5"]


def plan_json(capsys, *args) -> dict:
    assert main([*KIMI, *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_distinct_experts_go_from_k_to_all():
    """Uniform routing: E(1 - (1 - k/E)^T) distinct experts, k for one token, nearly all E for many;
    a spread of 0 (every token the same experts) stays at k."""
    c = SHAPES["kimi-k2.5"]
    d = Deployment(c, 1, GPUS["h200"], 1.0)
    assert distinct_experts(d, 1) == pytest.approx(8)
    assert distinct_experts(d, 4) == pytest.approx(384 * (1 - (1 - 8 / 384) ** 4))  # 31.0
    assert 383.9 < distinct_experts(d, 2000) <= 384
    assert distinct_experts(Deployment(c, 1, GPUS["h200"], 1.0, spread=0.0), 64) == pytest.approx(8)
    assert touched_experts(384, 8, 16) == pytest.approx(distinct_experts(d, 16))


def test_bytes_and_time_of_a_small_dense_config_by_hand():
    """hidden 64, MLP 128, 2 layers, 4 heads of 16, 2 KV heads, vocabulary 100, TP 2, context 10. A
    rank's parameters a layer: q, o 64x64/2 each, k and v one KV head each (64x16), MLP 3x64x128/2,
    two norms of 64; the output layer 100x64/2 and the final norm; cache 2 layers x K,V x 16 x 10."""
    c = SHAPES["llama-3.1-8b"].replace(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                                       num_kv_heads=2, head_dim=16, vocab_size=100)
    d = Deployment(c, 2, GPUS["h200"], 0.5, LINKS["pcie5"], context=10)
    b = step_bytes(d, 3)
    assert b.attention == 2 * 2 * (2048 + 2 * 1024 + 2048)
    assert b.mlp == 2 * 2 * 3 * 64 * 128 / 2 and b.norms_routers == 2 * 2 * 2 * 64
    assert b.head == 2 * (100 * 64 / 2 + 64) and b.cache == 2 * 2 * 2 * 16 * 10
    assert b.total == 2 * (12288 + 24576 + 256 + 3264 + 640) and b.routed == 0
    t = step_time(d, 3)
    assert t.bytes_ms == pytest.approx(b.total / (4.8e12 * 0.5) * 1e3)
    one = 6.6 + 2 * 1.0 + 3 * 64 * 2 * 2 / 2 / 63e3  # NCCL's ring latency, 2 ranks, then the bytes
    assert t.comm_ms == pytest.approx(2 * 2 * one / 1e3)
    assert bytes_per_param(("int4", 32)) == 0.5625 and bytes_per_param(("fp8", 128)) == 1 + 4 / 128 ** 2


def test_bytes_are_eaglets_own_count_of_its_models():
    """Unsplit and in bfloat16, a step's bytes are shapes.decode_bytes of the model built on the meta
    device (one byte count, two ways to reach it); split over ranks, eaglet's own TP slice's (the
    output layer vocabulary-parallel in both, as vLLM and SGLang run it)."""
    from eaglet.dist.tp import TP, local_config

    for name, n in (("deepseek-v2-lite", 1), ("qwen3-30b-a3b", 1), ("deepseek-v2-lite", 4)):
        c = SHAPES[name]
        with torch.device("meta"):
            m = CausalLM(local_config(c, TP(0, n))).to(torch.bfloat16)
        d = Deployment(c, n, GPUS["h200"], 1.0, LINKS["nvlink4"], context=100)
        for t in (1, 16):
            assert step_bytes(d, t).total == pytest.approx(decode_bytes(m, 100, t), abs=c.num_layers), name


def test_the_case_we_start_from(capsys):
    """Kimi-K2.5 (INT4 experts) on 8 PCIe GPUs (the case names no card: the RTX PRO 6000 of the published
    deployment), decode 12 ms, a 3-token verify 30.6 ms, accept length 2.1 with 2 draft steps:
    speculation loses, most of what the verify adds over a decode is overhead beyond its bytes and
    all-reduces, and the accept length needed is the step over the decode."""
    p = plan_json(capsys, "--decode-ms", "12", "--verify-ms", "30.6", "--steps", "2", "--accept-len", "2.1")
    g, draft = p["diagnosis"], p["draft_ms"]
    assert g["verdict"]["pays"] is False and 0.7 < g["verdict"]["speedup"] < 0.85
    assert g["excess_ms"] == pytest.approx(18.6)
    assert g["overhead_ms"] > 0.5 * g["excess_ms"] and g["overhead_ms"] + g["explained_ms"] == pytest.approx(18.6)
    assert g["verdict"]["break_even_tau"] == pytest.approx((2 * draft + 30.6) / 12)
    assert 0 < draft < 1  # the estimate: a one-layer head's bytes on 8 ranks
    # the fixed cost solved from the decode is carried into the verify: what is left there is the excess
    assert p["fixed_ms_solved"] == pytest.approx(12 - g["decode"]["bytes_ms"] - g["decode"]["comm_ms"])
    assert g["verify_left_ms"] == pytest.approx(g["overhead_ms"])
    assert g["at_model"]["speedup"] > 1.2  # what a verify at the model's cost would give at τ 2.1
    assert main([*KIMI, "--decode-ms", "12", "--verify-ms", "30.6", "--steps", "2", "--accept-len", "2.1"]) == 0
    out = capsys.readouterr().out
    assert "speculation loses" in out and f"must reach {g['verdict']['break_even_tau']:.2f}" in out
    assert "eaglet bench-moe --shape kimi-k2.5 --quant int4" in out and "eaglet env --tp 8" in out
    assert "step_profile.py --forward kimi-k2.5 OUT 1,2,3" in out  # the few-token paths a verify of 3 takes


def test_a_prediction_is_written_as_a_record(capsys, tmp_path):
    """--record-dir: the prediction as a record with its inputs and environment, the same figures the
    JSON prints."""
    p = plan_json(capsys, "--decode-ms", "12", "--verify-ms", "30.6", "--steps", "2", "--accept-len", "2.1",
                  "--record-dir", str(tmp_path))
    rec = json.loads((tmp_path / p["record"].rsplit("/", 1)[-1]).read_text())
    assert rec["kind"] == "plan-deployment" and rec["flags"]["verify_ms"] == 30.6 and "torch" in rec["environment"]
    assert rec["results"]["diagnosis"]["verdict"]["speedup"] == p["diagnosis"]["verdict"]["speedup"]


def test_the_published_pcie_deployment(capsys):
    """The same family (Kimi-K2.6: Kimi-K2.5's architecture, INT4 experts) on 8 RTX PRO 6000 over PCIe
    5, vLLM TP 8, EAGLE-3 with 3 draft tokens: plain 91.5 tok/s, 125.0 speculating with accept length
    1.95. From the plain rate alone the model predicts the speedup within 15% of 125.0 / 91.5."""
    p = plan_json(capsys, "--decode-ms", str(1000 / 91.5), "--steps", "3", "--accept-len", "1.95")
    chain3 = next(s for s in p["settings"] if s["name"] == "chain:3")
    assert chain3["tau"] == pytest.approx(1.95)
    assert abs(chain3["speedup"] / (125.0 / 91.5) - 1) < 0.15


def test_prediction_table_rises_with_tokens(capsys):
    assert main(KIMI) == 0
    out = capsys.readouterr().out
    assert "no fixed per-step cost" in out and "chain:3" in out and "tree:4,4,16" in out
    p = plan_json(capsys)
    ms = [s["ms"] for s in p["steps"]]
    assert [s["tokens"] for s in p["steps"]] == [1, 2, 3, 4, 6, 8, 16, 32, 64]
    assert all(a < b for a, b in zip(ms, ms[1:]))
    assert p["steps"][0]["bytes"]["experts"] == pytest.approx(8) and p["deployment"]["experts"] == ["int4", 32]
    assert p["deployment"]["efficiency"] == DEFAULT_EFFICIENCY and RELEASED["kimi-k2.5"] == ("int4", 32)
    be = [s["break_even_tau"] for s in p["settings"] if s["name"].startswith("chain")]
    assert all(a < b for a, b in zip(be, be[1:]))


def test_model_dir_and_measured_comm_curve(capsys, tmp_path):
    """--model reads a config.json as --shape reads the table; --comm replaces the link's model with a
    bench-comm record's curve (here a flat 50 µs at every size)."""
    (tmp_path / "config.json").write_text(json.dumps(SHAPES["qwen3-30b-a3b"].to_hf()))
    base = ["plan", "--tp", "2", "--gpu", "h100-sxm", "--link", "nvlink4", "--json"]
    assert main([*base, "--model", str(tmp_path)]) == 0
    by_dir = json.loads(capsys.readouterr().out)
    assert main([*base, "--shape", "qwen3-30b-a3b"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == by_dir["steps"]
    rec = tmp_path / "comm.json"
    rec.write_text(json.dumps({"kind": "bench-comm", "results": {"world": 2, "backend": "nccl", "rows": [
        {"bytes": 1024, "eager_us": 50.0, "graph_us": 50.0}, {"bytes": 1 << 20, "eager_us": 50.0, "graph_us": 50.0}]}}))
    assert main(["plan", "--shape", "qwen3-30b-a3b", "--tp", "2", "--gpu", "h100-sxm", "--comm", str(rec),
                 "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["steps"][0]["comm_ms"] == pytest.approx(2 * 48 * 50 / 1e3) and p["deployment"]["comm_curve"]


@pytest.mark.parametrize("args", [
    ["--gpu", "a100"], ["--link", "infiniband"], ["--tp", "7"], ["--shape", "kimi-k9"],
    ["--verify-ms", "30"], ["--efficiency", "1.5"], ["--accept-rate", "0.6", "--accept-len", "2", "--steps", "2"],
])
def test_bad_inputs_are_one_error_line(capsys, args):
    argv = list(KIMI)
    for flag, value in zip(args[::2], args[1::2]):
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("eaglet: error:")
    assert main(["plan", "--gpu", "h200", "--decode-ms", "12"]) == 1  # a deployment flag without a model


def test_expert_parallel_steps_wait_for_the_busiest_rank(capsys):
    """Under --moe-parallel ep a rank reads whole experts, and a step lasts as long as its busiest rank:
    the expected most distinct experts one rank's E/N are touched by, against a simulation of uniform
    routing (k of E without replacement per token) within 3%; one rank reads all that is touched.
    Kimi-K2.5 on 8 ranks: a decode's 8 experts crowd about 2.6 onto the busiest rank, 2.6x the routed
    bytes of the split by width; by 64 tokens every rank reads most of its own and the two near."""
    import random

    from eaglet.perf.step_model import busiest_rank

    rng = random.Random(0)
    for e, n, t, k in ((384, 8, 1, 8), (384, 8, 16, 8), (128, 4, 4, 8)):
        touched = touched_experts(e, k, t)
        runs, most = 1500, 0
        for _ in range(runs):
            hit = set().union(*(rng.sample(range(e), k) for _ in range(t)))
            most += max(sum(1 for x in hit if x // (e // n) == r) for r in range(n))
        sim = most / runs
        assert busiest_rank(e, n, touched) == pytest.approx(sim, rel=0.03), (e, n, t)
    assert busiest_rank(384, 1, 31.0) == pytest.approx(31.0)
    c = SHAPES["kimi-k2.5"].replace(num_layers=61)
    width, whole = (Deployment(c, 8, GPUS["rtx-pro-6000"], 1.0, LINKS["pcie5"], experts=RELEASED["kimi-k2.5"],
                               moe_split=split) for split in ("tp", "ep"))
    assert step_bytes(whole, 1).routed / step_bytes(width, 1).routed == pytest.approx(2.56, abs=0.05)
    assert 1 < step_bytes(whole, 64).routed / step_bytes(width, 64).routed < 1.15
    assert step_bytes(whole, 1).attention == step_bytes(width, 1).attention
    p = plan_json(capsys, "--moe-parallel", "ep", "--accept-rate", "0.5")
    assert p["deployment"]["moe_parallel"] == "ep"
