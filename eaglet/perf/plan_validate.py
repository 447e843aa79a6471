"""The step model against eaglet's own measurements: `eaglet plan --shape NAME --gpu G --moe-record
BENCH_MOE --against BENCH_SHAPE`. The bench-moe record gives the rate the fused MoE kernels read experts
at for each token count (one MoE layer alone); the bench --shape record gives the whole model's
forward of T = 1..64 tokens, graphed, and the distinct experts a layer touched at each T. The fixed
cost is solved from the measured decode (T = 1) and what a forward of several tokens adds from the
smallest verify (T = 2); every other T is a prediction, reported against its measurement."""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

from ..errors import InvalidInput
from ..models.fused_moe import shape_key
from .compare import load_record
from .shapes import SLICES, touched_experts
from .step_model import Deployment, drafter_ms, step_time

TOLERANCE = 0.10
CALIBRATION = (1, 2)  # decode, and the smallest verify
CHOICE_TOLERANCE = 0.03  # the chosen setting's measured rate against the best measured
ASSUMED_RATES = (0.5, 0.7, 0.8, 0.9)  # a draft token's acceptance, for the choice among chains


def moe_rate(path: str, config) -> tuple[tuple[int, float], ...]:
    """(tokens, GB/s) the fused kernels read routed experts at, from a bench-moe record's entry of
    this model's MoE shape (bf16): the copy bandwidth it measured x the fused kernels' share of it."""
    rec = load_record(path)
    if not rec.get("kind", "").startswith("bench-moe"):
        raise InvalidInput(f"--moe-record {path}: not an `eaglet bench-moe` record (kind {rec.get('kind')!r})")
    if config.moe is None:
        raise InvalidInput("--moe-record: this model has no routed experts")
    m = config.moe
    res, key = rec["results"], shape_key(m.num_experts, config.hidden_size, m.expert_size, m.top_k)
    entry = next((v for v in res["shapes"].values() if v.get("key") == key), None)
    if entry is None:
        raise InvalidInput(f"--moe-record {path}: no MoE layer of shape {key} in it "
                           f"(it has {', '.join(v.get('key', '?') for v in res['shapes'].values())})")
    return tuple((int(t), res["bandwidth_gb_s"] * v["fused_floor_ratio"]) for t, v in sorted(
        entry["tokens"].items(), key=lambda kv: int(kv[0])))


def setting_shape(name: str) -> tuple[int, int]:
    """(draft levels, tokens verified) of a bench --shape speculation entry: eagle3-chainS, eagle3-treeS,K,N."""
    m = re.fullmatch(r"eagle3-(chain|tree)(\d+(?:,\d+,\d+)?)", name)
    if m is None:
        raise InvalidInput(f"a speculation entry {name!r}: expected eagle3-chainS or eagle3-treeS,K,N")
    vals = [int(v) for v in m[2].split(",")]
    return (vals[0], vals[0] + 1) if m[1] == "chain" else (vals[0], vals[2])


@dataclass
class Point:
    tokens: int
    experts: float
    measured_ms: float
    predicted_ms: float
    calibration: bool

    @property
    def error(self) -> float:
        return self.predicted_ms / self.measured_ms - 1


def validate(d: Deployment, shape: str, path: str) -> dict:
    """The record's forward curve predicted T by T (d: the deployment of `shape` on one GPU)."""
    rec = load_record(path)
    res = rec.get("results", {})
    if res.get("shape") != shape:
        raise InvalidInput(f"--against {path}: a record of {res.get('shape')!r}, not of --shape {shape}")
    if d.tp != 1:
        raise InvalidInput("--against: the record ran on one GPU; give --tp 1")
    curve = res["slice"]["whole_ms"] if "slice" in res else res["forward_ms"].get("graphed") or res["forward_ms"]["eager"]
    curve = {int(t): ms for t, ms in curve.items() if int(t) <= 64}  # verify sizes; prefill past them
    # as the curve ran: its context, and random bfloat16 experts whatever format the release stores
    d = dataclasses.replace(d, context=res["context"] + rec["flags"]["max_new_tokens"] // 2, experts=None)

    def at(t: int) -> Deployment:  # the record's distinct experts at t (or the nearest count it measured),
        m = d.config.moe  # as a spread of uniform routing's
        if m is None or "experts" not in res:
            return d
        near = min(map(int, res["experts"]), key=lambda n: (abs(math.log2(n / t)), n))
        uniform = touched_experts(m.num_experts, m.top_k, near)
        return d if uniform <= m.top_k else dataclasses.replace(
            d, spread=(res["experts"][str(near)] - m.top_k) / (uniform - m.top_k))

    def model(t: int, fixed: float = 0.0, verify: float = 0.0):
        return step_time(dataclasses.replace(at(t), fixed_ms=fixed, verify_fixed_ms=verify), t)

    fixed = curve[1] - model(1).ms  # (as calibrated(), per T at the record's own spread)
    verify = curve[2] - model(2, fixed).ms
    points = [Point(t, model(t).bytes.experts, curve[t], model(t, fixed, verify).ms, t in CALIBRATION)
              for t in sorted(curve)]
    checked = [p for p in points if not p.calibration]
    spec = {}
    # an untrained head (τ about 1): each step S draft levels and a verify of S + 1 tokens (a chain) or of
    # N nodes (a tree); a slice's steps ran on the slice, not the model: not compared
    for name, s in ({} if "slice" in res else res.get("speculation", {})).items():
        steps, tokens = setting_shape(name)
        spec[name] = {"measured_step_ms": s["ms_per_step"], "tau": s["accept_length"], "verify_tokens": tokens,
                      "predicted_step_ms": model(tokens, fixed, verify).ms + steps * drafter_ms(d),
                      "measured_tok_s": s["tok_s"]}
    plain = res["decode"].get("graphed") or res["decode"]["eager"]
    return {"record": str(path), "shape": shape, "context": d.context, "fixed_ms": fixed, "verify_fixed_ms": verify,
            "moe_rate": d.moe_rate, "tolerance": TOLERANCE,
            "points": [{**dataclasses.asdict(p), "error": p.error} for p in points],
            "within": sum(abs(p.error) <= TOLERANCE for p in checked), "checked": len(checked),
            "speculation": spec, "plain_tok_s": plain["tok_s"], "choices": choices(spec, plain["tok_s"], curve[1]),
            "whole_model_from_slice": SLICES.get(shape) if "slice" in res else None}


def choose(options: dict[str, tuple[float, float]]) -> dict:
    """options: name -> (predicted, measured) speedup over plain decoding; the planner takes the best
    predicted, and is right when that one's measured speedup is within CHOICE_TOLERANCE of the best measured."""
    chosen = max(options, key=lambda n: options[n][0])
    best = max(options, key=lambda n: options[n][1])
    share = options[chosen][1] / options[best][1]
    return {"chosen": chosen, "best_measured": best, "chosen_of_best": share,
            "ok": share >= 1 - CHOICE_TOLERANCE, "speedups": options}


def choices(spec: dict, plain_tok_s: float, decode_ms: float) -> list[dict]:
    """decode_ms: the modelled decode (the measured forward of one token, which calibrates the model).
    The setting the planner would choose among plain decoding and the settings measured: at the accept
    lengths measured (speedup = tok/s over plain's; predicted τ x the modelled decode over the modelled
    step), and for the chains at assumed acceptance rates a (τ = 1 + a + .. + a^S over each step's
    measured and predicted cost: a graphed chain step costs the same whatever it accepts)."""
    if not spec:
        return []
    plain_ms = 1e3 / plain_tok_s
    out = [{"acceptance": "measured", **choose({"plain": (1.0, 1.0), **{
        n: (s["tau"] * decode_ms / s["predicted_step_ms"], s["measured_tok_s"] / plain_tok_s)
        for n, s in spec.items()}})}]
    chains = {n: s for n, s in spec.items() if "chain" in n}
    for a in ASSUMED_RATES if chains else ():
        opts = {"plain": (1.0, 1.0)}
        for n, s in chains.items():
            tau = sum(a ** i for i in range(setting_shape(n)[0] + 1))
            opts[n] = (tau * decode_ms / s["predicted_step_ms"], tau * plain_ms / s["measured_step_ms"])
        out.append({"acceptance": a, **choose(opts)})
    return out


def print_validation(v: dict) -> None:
    sliced = f" (the {v['whole_model_from_slice']}-layer model from its slice)" if v["whole_model_from_slice"] else ""
    rate = "at the fused kernels' measured rate" if v["moe_rate"] else "at the decode's efficiency"
    print(f"{v['shape']}{sliced}, context {v['context']}, against {v['record']}: routed experts {rate}; "
          f"fixed {v['fixed_ms']:.3f} ms solved from T = 1, a verify's extra {v['verify_fixed_ms']:.3f} ms from T = 2")
    print(f"{'tokens':>7}{'experts':>9}{'measured ms':>13}{'predicted ms':>14}{'error':>9}")
    for p in v["points"]:
        note = "  (calibration)" if p["calibration"] else "" if abs(p["error"]) <= v["tolerance"] else "  outside"
        print(f"{p['tokens']:>7}{p['experts']:>9.1f}{p['measured_ms']:>13.3f}{p['predicted_ms']:>14.3f}"
              f"{p['error']:>+9.1%}{note}")
    print(f"{v['within']} of {v['checked']} predicted token counts within ±{v['tolerance']:.0%} of measured")
    if v["speculation"]:
        print(f"speculation, an untrained head (plain decoding {v['plain_tok_s']:.1f} tok/s); a step predicted as "
              f"the verify plus each draft level's bytes (a draft's fixed cost not modelled):")
    for name, s in v["speculation"].items():
        print(f"  {name:<20} τ {s['tau']:.2f}: {s['measured_tok_s']:7.1f} tok/s, a step {s['measured_step_ms']:.3f} ms "
              f"measured, {s['predicted_step_ms']:.3f} predicted ({s['predicted_step_ms'] / s['measured_step_ms'] - 1:+.1%})")
    for c in v.get("choices", []):
        when = "at the accept lengths measured" if c["acceptance"] == "measured" else \
            f"chains, each draft token accepted at {c['acceptance']:.1f} (steps measured)"
        pred, meas = c["speedups"][c["chosen"]]
        print(f"  chosen {when}: {c['chosen']} (predicted {pred:.2f}x, measured {meas:.2f}x); best measured "
              f"{c['best_measured']} ({c['speedups'][c['best_measured']][1]:.2f}x): {c['chosen_of_best']:.1%} of it"
              + ("" if c["ok"] else f"  outside {CHOICE_TOLERANCE:.0%}"))
