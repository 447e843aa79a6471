"""The step model against measurement (perf/plan_validate.py, `plan --moe-record --against`): routed
experts timed at the MoE kernels' measured rate; the fixed costs solved from a decode and a verify
of 2; the other token counts predicted. On synthetic records whose curve the model made (so errors
are zero, and a disturbed point is named), and on the H200 records BENCHMARKS.md cites."""
import dataclasses
import json
from pathlib import Path

import pytest

from eaglet.cli import main
from eaglet.errors import InvalidInput
from eaglet.perf.hardware import GPUS
from eaglet.models.fused_moe import shape_key
from eaglet.perf.plan_validate import validate
from eaglet.perf.shapes import SHAPES
from eaglet.perf.step_model import Deployment, moe_gb_s, step_bytes, step_time

RESULTS = Path(__file__).parent.parent / "bench" / "results"
MOE = RESULTS / "bench-moe-gpu-20261204-171449.json"
H200 = {"qwen3-30b-a3b": "bench-shape-qwen3-30b-a3b-gpu-20261204-165626.json",
        "deepseek-v2-lite": "bench-shape-deepseek-v2-lite-gpu-20261204-165909.json",
        "kimi-k2": "bench-shape-kimi-k2-gpu-20261204-170515.json",
        "mixtral-8x7b": "bench-shape-mixtral-8x7b-gpu-20261204-170806.json"}
RATE = ((1, 3000.0), (4, 4000.0), (64, 4400.0))


def test_the_measured_rate_between_and_beyond_its_token_counts():
    assert moe_gb_s(RATE, 1) == 3000 and moe_gb_s(RATE, 4) == 4000 and moe_gb_s(RATE, 200) == 4400
    assert moe_gb_s(RATE, 2) == pytest.approx(3500)  # halfway in log2 between 1 and 4
    assert moe_gb_s(RATE, 16) == pytest.approx(4200)


def test_routed_experts_at_their_rate_the_rest_at_the_efficiency():
    c = SHAPES["qwen3-30b-a3b"]
    d = Deployment(c, 1, GPUS["h200"], 0.5, context=100)
    b = step_bytes(d, 4)
    with_rate = step_time(dataclasses.replace(d, moe_rate=RATE, fixed_ms=1.0, verify_fixed_ms=0.25), 4)
    assert with_rate.bytes_ms == pytest.approx(((b.total - b.routed) / (4800e9 * 0.5) + b.routed / 4000e9) * 1e3)
    assert with_rate.fixed_ms == 1.25 and step_time(dataclasses.replace(d, verify_fixed_ms=0.25), 1).fixed_ms == 0


def record(tmp_path: Path, shape: str, fixed: float, verify: float, disturb: dict | None = None) -> Path:
    """A bench --shape record whose forward curve the step model made (uniform routing, bf16 experts,
    context 64 + 32 / 2), `disturb` multiplying some of its points."""
    d = Deployment(SHAPES[shape], 1, GPUS["h200"], 0.766, context=80, moe_rate=RATE, fixed_ms=fixed,
                   verify_fixed_ms=verify)
    curve = {str(t): step_time(d, t).ms * (disturb or {}).get(t, 1.0) for t in (1, 2, 4, 8, 16, 32, 64, 128)}
    experts = {t: step_bytes(d, int(t)).experts for t in curve}
    results = {"shape": shape, "context": 64, "forward_ms": {"graphed": curve}, "experts": experts,
               "decode": {"graphed": {"tok_s": 1e3 / curve["1"]}}}
    p = tmp_path / f"bench-shape-{shape}.json"
    p.write_text(json.dumps({"kind": f"bench-shape-{shape}", "flags": {"max_new_tokens": 32},
                             "environment": {}, "results": results}))
    return p


def moe_record(tmp_path: Path, shape: str) -> Path:
    """A bench-moe record: copy bandwidth 5000 GB/s, the fused kernels at RATE's share of it."""
    tokens = {str(t): {"fused_floor_ratio": r / 5000} for t, r in RATE}
    m = SHAPES[shape].moe
    p = tmp_path / "bench-moe.json"
    p.write_text(json.dumps({"kind": "bench-moe", "environment": {}, "results": {"bandwidth_gb_s": 5000, "shapes": {
        shape: {"key": shape_key(m.num_experts, SHAPES[shape].hidden_size, m.expert_size, m.top_k),
                "tokens": tokens}}}}))
    return p


def test_a_curve_the_model_made_is_predicted_exactly_and_a_disturbed_point_is_named(tmp_path, capsys):
    shape = "qwen3-30b-a3b"
    args = ["plan", "--shape", shape, "--gpu", "h200", "--moe-record", str(moe_record(tmp_path, shape))]
    assert main([*args, "--against", str(record(tmp_path, shape, 1.5, 0.4)), "--json"]) == 0
    v = json.loads(capsys.readouterr().out)
    assert v["fixed_ms"] == pytest.approx(1.5) and v["verify_fixed_ms"] == pytest.approx(0.4)
    assert [p["tokens"] for p in v["points"]] == [1, 2, 4, 8, 16, 32, 64]  # verify sizes only
    assert all(abs(p["error"]) < 1e-9 for p in v["points"]) and (v["within"], v["checked"]) == (5, 5)
    assert main([*args, "--against", str(record(tmp_path, shape, 1.5, 0.4, {16: 1.25}))]) == 0
    out = capsys.readouterr().out
    assert "4 of 5 predicted token counts within ±10%" in out
    assert [line.split()[0] for line in out.splitlines() if line.endswith("outside")] == ["16"]


def test_bad_validation_inputs_are_one_line_errors(tmp_path, capsys):
    rec = str(record(tmp_path, "qwen3-30b-a3b", 1.0, 0.0))
    for args, said in ((["--shape", "mixtral-8x7b", "--against", rec], "a record of 'qwen3-30b-a3b'"),
                       (["--shape", "qwen3-30b-a3b", "--moe-record", rec], "not an `eaglet bench-moe` record"),
                       (["--shape", "mixtral-8x7b", "--moe-record", str(moe_record(tmp_path, "qwen3-30b-a3b"))],
                        "no MoE layer of shape E8-H4096-I14336-k2"),
                       (["--shape", "llama-3.1-8b", "--moe-record", str(moe_record(tmp_path, "qwen3-30b-a3b"))],
                        "has no routed experts")):
        assert main(["plan", "--gpu", "h200", *args]) == 1
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("shape", list(H200))
def test_the_h200_curves_within_ten_percent(shape, capsys):
    """BENCHMARKS.md's figures: the whole models' graphed forward of 4..64 tokens (Kimi-K2's 61
    layers from its slice) within ±10% of the step model at the MoE kernels' measured rate."""
    assert main(["plan", "--shape", shape, "--gpu", "h200", "--moe-record", str(MOE), "--against",
                 str(RESULTS / H200[shape]), "--json"]) == 0
    v = json.loads(capsys.readouterr().out)
    assert (v["within"], v["checked"]) == (5, 5)
    assert max(abs(p["error"]) for p in v["points"]) < 0.05


def test_a_slice_is_checked_as_the_whole_model_and_on_one_gpu_only():
    d = Deployment(SHAPES["kimi-k2"].replace(num_layers=61), 1, GPUS["h200"], 0.766)
    v = validate(d, "kimi-k2", str(RESULTS / H200["kimi-k2"]))
    assert v["whole_model_from_slice"] == 61 and not v["speculation"]  # the slice's steps are not the model's
    assert v["points"][0]["measured_ms"] == json.loads((RESULTS / H200["kimi-k2"]).read_text())[
        "results"]["slice"]["whole_ms"]["1"]
    with pytest.raises(InvalidInput, match="give --tp 1"):
        validate(dataclasses.replace(d, tp=2), "kimi-k2", str(RESULTS / H200["kimi-k2"]))


def test_speculation_settings_of_a_shape_and_their_predicted_steps(monkeypatch, tmp_path, capsys):
    """`bench --shape --spec-settings` times each setting named (an untrained head, CPU, float32: each
    equals plain decoding) and `plan --against` sets each measured step beside the verify and draft
    levels the model predicts; a bad setting, or the flag without --shape, is one error line."""
    from eaglet.perf import shapes

    q = SHAPES["qwen3-30b-a3b"]
    tiny = dataclasses.replace(q, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4, num_kv_heads=2,
                               head_dim=16, vocab_size=256,
                               moe=dataclasses.replace(q.moe, num_experts=16, expert_size=32, top_k=2))
    monkeypatch.setitem(shapes.SHAPES, "tiny-qwen3-moe", tiny)
    bench = ["bench", "--shape", "tiny-qwen3-moe", "--device", "cpu", "--context", "32", "--max-new-tokens", "8",
             "--repeats", "1", "--out", str(tmp_path)]
    assert main([*bench, "--spec-settings", "chain:1", "chain:2", "tree:2,2,4"]) == 0
    path = next(tmp_path.glob("bench-shape-tiny-qwen3-moe-cpu-*.json"))
    spec = json.loads(path.read_text())["results"]["speculation"]
    assert list(spec) == ["eagle3-chain1", "eagle3-chain2", "eagle3-tree2,2,4"]
    assert all(s["equals_plain"] and s["ms_per_step"] > 0 for s in spec.values())
    capsys.readouterr()
    assert main(["plan", "--shape", "tiny-qwen3-moe", "--gpu", "h200", "--against", str(path), "--json"]) == 0
    v = json.loads(capsys.readouterr().out)
    assert [(n, s["verify_tokens"]) for n, s in v["speculation"].items()] == [
        ("eagle3-chain1", 2), ("eagle3-chain2", 3), ("eagle3-tree2,2,4", 4)]
    assert all(s["predicted_step_ms"] > 0 for s in v["speculation"].values())
    for args, said in ((["--spec-settings", "chain"], "bad setting 'chain'"),):
        assert main([*bench, *args]) == 1
        assert said in capsys.readouterr().err
    assert main(["bench", "--device", "cpu", "--spec-settings", "chain:1"]) == 1
    assert "give --shape" in capsys.readouterr().err


SPEC = {"qwen3-30b-a3b": "bench-shape-qwen3-30b-a3b-gpu-20261204-185915.json",
        "deepseek-v2-lite": "bench-shape-deepseek-v2-lite-gpu-20261204-190232.json"}


@pytest.mark.parametrize("shape", list(SPEC))
def test_the_six_h200_settings_and_the_choice_among_them(shape, capsys):
    """BENCHMARKS.md's six speculation settings (an untrained head) on the H200: each step predicted
    within ±10%, and the setting the planner chooses, at the measured accept lengths and for chains at
    assumed acceptance rates, within 3% of the best measured."""
    assert main(["plan", "--shape", shape, "--gpu", "h200", "--moe-record", str(MOE), "--against",
                 str(RESULTS / SPEC[shape]), "--json"]) == 0
    v = json.loads(capsys.readouterr().out)
    assert len(v["speculation"]) == 6 and (v["within"], v["checked"]) == (5, 5)
    assert all(abs(s["predicted_step_ms"] / s["measured_step_ms"] - 1) <= 0.10 for s in v["speculation"].values())
    assert [c["acceptance"] for c in v["choices"]] == ["measured", 0.5, 0.7, 0.8, 0.9]
    assert v["choices"][0]["chosen"] == "plain"  # τ 1: nothing to gain
    assert v["choices"][-1]["chosen"] == "eagle3-chain5"  # the deepest chain once drafts are mostly right
    assert all(c["ok"] and c["chosen_of_best"] >= 0.97 for c in v["choices"])


def test_a_choice_the_measurement_contradicts_is_named():
    from eaglet.perf.plan_validate import choices, choose

    c = choose({"plain": (1.0, 1.0), "a": (1.3, 1.1), "b": (1.2, 1.25)})
    assert (c["chosen"], c["best_measured"], c["ok"]) == ("a", "b", False)
    assert c["chosen_of_best"] == pytest.approx(1.1 / 1.25)
    # chains at an assumed rate: τ = 1 + a + .. + a^S over each step (plain decoding 100 tok/s = 10 ms)
    spec = {"eagle3-chain1": {"tau": 1.0, "predicted_step_ms": 11.0, "measured_step_ms": 12.0, "measured_tok_s": 80.0},
            "eagle3-chain3": {"tau": 1.0, "predicted_step_ms": 13.0, "measured_step_ms": 25.0, "measured_tok_s": 50.0}}
    out = choices(spec, 100.0, 10.0)
    assert out[0]["chosen"] == "plain" and out[0]["ok"]
    at9 = next(c for c in out if c["acceptance"] == 0.9)
    assert at9["speedups"]["eagle3-chain3"] == pytest.approx(
        ((1 + .9 + .81 + .729) * 10 / 13, (1 + .9 + .81 + .729) * 10 / 25))
    assert (at9["chosen"], at9["best_measured"], at9["ok"]) == ("eagle3-chain3", "eagle3-chain1", False)
    assert choices({}, 100.0, 10.0) == []
