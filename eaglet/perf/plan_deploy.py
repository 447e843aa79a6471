"""`eaglet plan --shape NAME | --model DIR --tp N --gpu G --link L`: a deployment's step costs from the
step model (perf/step_model.py). Prediction: decode and verify(T) with the bytes split and the
all-reduces' share, the break-even accept length of chains 1..6 and a few trees, the best chain for an
acceptance given or measured. With --verify-ms (and --decode-ms, --steps, an accept length): the
diagnosis of another engine's numbers (perf/diagnosis.py)."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from ..config import ModelConfig
from ..dist.tp import MOE_SPLITS
from ..errors import InvalidInput
from . import hardware
from .cost import Costs, chain_tau, tau_from_positions
from .step_model import Deployment, calibrated, drafter_ms, step_time

TOKENS = (1, 2, 3, 4, 6, 8, 16, 32, 64)
CHAINS = range(1, 7)
TREES = ((3, 4, 8), (4, 4, 16), (6, 8, 32))  # STEPS,TOPK,TOKENS: break-even only (their τ needs a profile)
FORMATS = {"bf16": None, "fp8": ("fp8", 128), "int4": ("int4", 32)}  # a release's own group wins (shapes.RELEASED)


def add_args(pl) -> None:
    """The plan parser's deployment flags."""
    from .shapes import SHAPES

    pl.add_argument("--record-dir", metavar="DIR", help="with --shape/--model: also write the prediction as a JSON "
                                                          "record there (its inputs and environment)")
    pl.add_argument("--shape", help=f"a model shape eaglet knows: {', '.join(SHAPES)}")
    pl.add_argument("--model", help="a HF model directory: its config.json (weights not needed)")
    pl.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (GPUs)")
    pl.add_argument("--gpu", help=f"one of {', '.join(hardware.GPUS)}")
    pl.add_argument("--link", help=f"between the GPUs, one of {', '.join(hardware.LINKS)} (not needed with --comm)")
    pl.add_argument("--comm", metavar="RECORD", help="an `eaglet bench-comm` record: its measured all-reduce "
                                                     "curve instead of the link's model")
    pl.add_argument("--efficiency", type=float, help=f"fraction of peak bandwidth a step reads at (default "
                                                     f"{hardware.DEFAULT_EFFICIENCY}: eaglet's H200 decode)")
    pl.add_argument("--context", type=int, default=1024, help="tokens in the cache")
    pl.add_argument("--experts-format", choices=list(FORMATS), help="routed experts as stored (default: the "
                                                                      "shape's release, or the config's quantization)")
    pl.add_argument("--moe-parallel", choices=MOE_SPLITS, default="tp",
                    help="routed experts split by width over the ranks (tp), or whole, E/N a rank (ep: a step waits "
                         "for the rank its tokens' experts crowd most)")
    pl.add_argument("--routing-spread", type=float, default=1.0,
                    help="distinct experts beyond a token's k, as a fraction of uniform routing's (1: uniform; "
                         "from the MoE counters: (measured - k) / (uniform - k))")
    pl.add_argument("--moe-record", metavar="RECORD", help="an `eaglet bench-moe` record with this model's MoE "
                                                           "shape: routed experts read at its fused kernels' "
                                                           "measured rate for each token count")
    pl.add_argument("--against", metavar="RECORD", help="an `eaglet bench --shape` record of --shape on one GPU: "
                                                        "fixed costs solved from its decode and its verify of 2, "
                                                        "every other token count predicted against its measurement")
    pl.add_argument("--accept-rate", type=float, help="per-token acceptance α: a chain of s gives (1-α^(s+1))/(1-α)")
    pl.add_argument("--accept-curve", type=float, nargs="+", metavar="A",
                    help="per-position acceptance a1 a2 ...: a chain of s gives 1 + a1 + ... + as")


@dataclass
class Setting:
    name: str
    steps: int
    tokens: int
    step_ms: float
    break_even_tau: float
    tau: float | None = None
    speedup: float | None = None


def model_config(args) -> tuple[ModelConfig, str, tuple[str, int] | None, str | None]:
    """(the whole model's config, how commands name it, its routed experts' release format, a shape of
    its MoE layers' size)."""
    from .shapes import RELEASED, SHAPES, SLICES

    if (args.shape is None) == (args.model is None):
        raise InvalidInput("give one of --shape and --model")
    if args.shape is not None:
        if args.shape not in SHAPES:
            raise InvalidInput(f"--shape {args.shape}: unknown (choose from {', '.join(SHAPES)})")
        c = SHAPES[args.shape]
        c = c.replace(num_layers=SLICES.get(args.shape, c.num_layers))
        return c, f"--shape {args.shape}", RELEASED.get(args.shape), args.shape if c.moe else None
    from ..config import text_config
    from ..models.moe_stored import storable
    from ..weights.quant import scheme

    hf = json.loads((Path(args.model) / "config.json").read_text())
    c = ModelConfig.from_hf(hf)
    method = scheme(hf.get("quantization_config") or text_config(hf).get("quantization_config"))
    same = next((n for n, s in SHAPES.items() if c.moe and s.moe and (s.hidden_size, s.moe.expert_size,
                 s.moe.num_experts, s.moe.top_k) == (c.hidden_size, c.moe.expert_size, c.moe.num_experts,
                                                     c.moe.top_k)), None)
    return c, f"--model {args.model}", storable(*method) if method and c.moe else None, same


def deployment(args) -> tuple[Deployment, str, str | None]:
    from ..dist.comm_curve import load_curve
    from ..dist.tp import check

    c, target, released, moe_shape = model_config(args)
    if args.tp < 1:
        raise InvalidInput(f"--tp {args.tp}: must be at least 1")
    check(c, args.tp, args.moe_parallel)  # heads, KV heads, widths (experts) split N ways, or an error naming it
    if args.gpu is None:
        raise InvalidInput(f"--gpu is needed (one of {', '.join(hardware.GPUS)})")
    comm = link = None
    if args.comm:
        try:
            comm = load_curve(args.comm, graph=True)  # decode and verify run in graphs where the record has them
        except InvalidInput:
            comm = load_curve(args.comm)
        if comm.world != args.tp:
            raise InvalidInput(f"--comm {args.comm}: measured over {comm.world} ranks, not --tp {args.tp}")
    elif args.link is not None:
        link = hardware.link(args.link)
    elif args.tp > 1:
        raise InvalidInput(f"--tp {args.tp} needs --link ({', '.join(hardware.LINKS)}) or --comm RECORD")
    eff = hardware.DEFAULT_EFFICIENCY if args.efficiency is None else args.efficiency
    if not 0 < eff <= 1:
        raise InvalidInput(f"--efficiency {eff}: a fraction in (0, 1]")
    if args.context < 0 or not 0 <= args.routing_spread <= 1:
        raise InvalidInput("--context must be >= 0 and --routing-spread in [0, 1]")
    experts = released
    if args.experts_format is not None:
        if c.moe is None:
            raise InvalidInput("--experts-format: this model has no routed experts")
        fmt = FORMATS[args.experts_format]
        experts = released if released and fmt and released[0] == fmt[0] else fmt
    return Deployment(c, args.tp, hardware.gpu(args.gpu), eff, link, comm, experts, args.context,
                      args.routing_spread, moe_split=args.moe_parallel), target, moe_shape


def solve_alpha(tau: float, steps: int) -> float:
    """The per-token rate α at which a chain of `steps` has accept length τ (bisection; τ rises with α)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chain_tau(mid, steps) < tau else (lo, mid)
    return (lo + hi) / 2


def acceptance(args, tau: float | None):
    """(τ of a chain of s, or None; where it came from)."""
    given = [args.accept_rate, args.accept_curve, tau]
    if sum(g is not None for g in given) > 1:
        raise InvalidInput("give one of --accept-rate, --accept-curve and --accept-len / --metrics-url")
    if args.accept_rate is not None:
        if not 0 <= args.accept_rate <= 1:
            raise InvalidInput(f"--accept-rate {args.accept_rate}: a probability in [0, 1]")
        return (lambda s: chain_tau(args.accept_rate, s)), f"α = {args.accept_rate:.3f} given"
    if args.accept_curve is not None:
        if any(not 0 <= a <= 1 for a in args.accept_curve):
            raise InvalidInput("--accept-curve: rates in [0, 1]")
        curve = args.accept_curve
        return (lambda s: tau_from_positions(curve, s) if s <= len(curve) else None), "the acceptance curve given"
    if tau is not None:
        alpha = solve_alpha(tau, args.steps)
        return (lambda s: chain_tau(alpha, s)), (f"α = {alpha:.3f}, solved from accept length {tau:.2f} at "
                                                 f"chain {args.steps}")
    return None, None


def settings(d: Deployment, decode_ms: float, draft_ms: float, other_ms: float, tau_of) -> list[Setting]:
    need = {s + 1 for s in CHAINS} | {n for _, _, n in TREES}
    costs = Costs(decode_ms, draft_ms, {t: step_time(d, t).ms for t in need}, other_ms)
    out = []
    for s in CHAINS:
        tau = tau_of(s) if tau_of else None
        out.append(Setting(f"chain:{s}", s, s + 1, costs.step_ms(s, s + 1), costs.break_even_tau(s, s + 1), tau,
                           None if tau is None else costs.speedup(tau, s, s + 1)))
    for s, k, n in TREES:
        out.append(Setting(f"tree:{s},{k},{n}", s, n, costs.step_ms(s, n), costs.break_even_tau(s, n)))
    return out


def plan_deployment(args) -> int:
    from .diagnosis import diagnose, lines

    d, target, moe_shape = deployment(args)
    if args.moe_record:
        from .plan_validate import moe_rate

        d = dataclasses.replace(d, moe_rate=moe_rate(args.moe_record, d.config))
    if args.against:
        return against(args, d)
    tau = args.accept_len
    if args.metrics_url:
        from .external import accept_length_from_metrics, fetch_metrics

        tau, _ = accept_length_from_metrics(fetch_metrics(args.metrics_url))
    if tau is not None and (args.steps is None or not 1 <= tau <= args.steps + 1):
        raise InvalidInput("an accept length needs --steps, and lies in [1, steps + 1]")
    if args.verify_ms is not None and (args.decode_ms is None or tau is None):
        raise InvalidInput("diagnosis (--verify-ms) needs --decode-ms, --steps and --accept-len or --metrics-url")
    for name in ("decode_ms", "verify_ms"):
        if getattr(args, name) is not None and not getattr(args, name) > 0:
            raise InvalidInput(f"--{name.replace('_', '-')} must be positive")
    if (args.draft_ms is not None and args.draft_ms < 0) or args.other_ms < 0:
        raise InvalidInput("--draft-ms and --other-ms must be >= 0")
    tau_of, source = acceptance(args, tau)
    left = None
    if args.decode_ms is not None:
        d, left = calibrated(d, args.decode_ms)
    rows = [step_time(d, t) for t in TOKENS]
    decode_ms = rows[0].ms
    draft = drafter_ms(d) if args.draft_ms is None else args.draft_ms
    table = settings(d, decode_ms, draft, args.other_ms, tau_of)
    ranked = sorted((s for s in table if s.speedup is not None), key=lambda s: -s.speedup)
    best = ranked[0] if ranked else None
    diag = None
    if args.verify_ms is not None:
        diag = diagnose(d, args.decode_ms, args.verify_ms, args.steps, tau, draft, args.other_ms, target, moe_shape)
    payload = {"deployment": describe(d, target), "fixed_ms_solved": left, "draft_ms": draft,
               "draft_ms_source": "given" if args.draft_ms is not None else "estimate",
               "steps": [{**dataclasses.asdict(r), "ms": r.ms, "bytes_total": r.bytes.total} for r in rows],
               "settings": [vars(s) for s in table], "acceptance": source, "best": vars(best) if best else None,
               "diagnosis": None if diag is None else {
                   **dataclasses.asdict(diag), "excess_ms": diag.excess_ms,
                   "decode_left_ms": diag.decode.left_ms, "verify_left_ms": diag.verify.left_ms}}
    if args.record_dir:
        payload["record"] = written(args, "plan-deployment", payload)
    if args.json:
        print(json.dumps(payload, default=str))
        return 0
    if diag is not None:  # the verdict on today's numbers first, then the model, then where they part
        print("\n".join(diag.verdict.lines(tau, args.verify_ms)))
    print_prediction(d, target, rows, left, draft, args.draft_ms is None, table, best, source)
    if diag is not None:
        print("\n".join(lines(diag, tau, args.steps)))
    if args.record_dir:
        print(f"record: {payload['record']}")
    return 0


def written(args, kind: str, payload: dict) -> str:
    """`payload` as a `kind` record in --record-dir, with the flags and the environment: its path."""
    from .record import write_record

    flags = {k: val for k, val in vars(args).items() if k != "func"}
    return str(write_record(kind, flags, json.loads(json.dumps(payload, default=str)), args.record_dir))


def against(args, d: Deployment) -> int:
    """`--against RECORD`: the step model's forward curve T by T against a bench --shape record's."""
    from .plan_validate import print_validation, validate

    if args.shape is None:
        raise InvalidInput("--against needs --shape (the record's shape)")
    v = validate(d, args.shape, args.against)
    if args.record_dir:
        v["written"] = written(args, "plan-validation", v)
    if args.json:
        print(json.dumps(v, default=str))
    else:
        print_validation(v)
        if args.record_dir:
            print(f"record: {v['written']}")
    return 0


def describe(d: Deployment, target: str) -> dict:
    c = d.config
    return {"model": target, "layers": c.num_layers, "tp": d.tp, "gpu": d.gpu.name, "gpu_source": d.gpu.source,
            "link": d.link.name if d.link else None, "link_source": d.link.source if d.link else None,
            "comm_curve": d.comm is not None, "experts": d.experts, "efficiency": d.efficiency,
            "context": d.context, "routing_spread": d.spread, "fixed_ms": d.fixed_ms, "moe_parallel": d.moe_split,
            "moe_rate_gb_s": d.moe_rate}


def print_prediction(d: Deployment, target: str, rows, left, draft: float, estimated: bool, table, best,
                     source) -> None:
    c, one = d.config, rows[0]
    fmt = "bf16" if not d.experts else f"int4, a scale per {d.experts[1]}" if d.experts[0] == "int4" else \
        f"fp8, a scale per {d.experts[1]} x {d.experts[1]} block"
    comm = "a measured bench-comm curve" if d.comm is not None else d.link.name if d.link else "none"
    print(f"{target.split(' ', 1)[1]}: {c.num_layers} layers on {d.tp} x {d.gpu.name} "
          f"({d.gpu.bandwidth_gb_s:.0f} GB/s at "
          f"{d.efficiency:.0%}{', routed experts at the measured MoE kernels rate' if d.moe_rate else ''}), "
          f"all-reduces: {comm}; "
          + (f"routed experts {fmt}, {'whole, E/N a rank' if d.moe_split == 'ep' else 'split by width'}; "
             if c.moe else "")
          + f"context {d.context}")
    b = one.bytes
    print(f"a rank reads {b.total / 1e9:.2f} GB a decode step: attention {b.attention / 1e9:.2f}, dense MLPs "
          f"{b.mlp / 1e9:.2f}, shared experts {b.shared / 1e9:.2f}, routed experts {b.routed / 1e9:.2f}, norms and "
          f"routers {b.norms_routers / 1e9:.2f}, output layer {b.head / 1e9:.2f} (split over ranks), cache "
          f"{b.cache / 1e9:.2f}")
    if left is None:
        print("no fixed per-step cost (give --decode-ms to solve it from a measured decode): times are lower bounds")
    else:
        print(f"fixed per-step cost {d.fixed_ms:.2f} ms, solved from the measured decode ({one.ms:.2f} ms = bytes "
              f"{one.bytes_ms:.2f} + all-reduces {one.comm_ms:.2f} + fixed)"
              + (f"; the model alone exceeds it by {-left:.2f} ms" if left < 0 else ""))
    print(f"{'tokens':>7}{'experts':>9}{'GB/rank':>9}{'bytes ms':>10}{'all-red. ms':>12}{'fixed ms':>10}"
          f"{'total ms':>10}{'x decode':>10}")
    for r in rows:
        print(f"{r.tokens:>7}{r.bytes.experts:>9.1f}{r.bytes.total / 1e9:>9.2f}{r.bytes_ms:>10.2f}{r.comm_ms:>12.2f}"
              f"{r.fixed_ms:>10.2f}{r.ms:>10.2f}{r.ms / one.ms:>10.2f}")
    how = "estimate: an EAGLE-3 head's bytes and all-reduces, no fixed cost" if estimated else "given"
    print(f"draft step {draft:.2f} ms ({how}); acceptance: {source or 'none given (break-even only)'}")
    print(f"{'setting':<14}{'tokens':>7}{'step ms':>9}{'break-even τ':>14}{'τ':>7}{'speedup':>9}")
    for s in table:
        extra = f"{s.tau:>7.2f}{s.speedup:>8.2f}x" if s.speedup is not None else ""
        print(f"{s.name:<14}{s.tokens:>7}{s.step_ms:>9.2f}{s.break_even_tau:>14.2f}{extra}")
    if best is not None:
        verdict = (f"speculate with {best.name}" if best.speedup > 1 else "don't speculate: the best chain is "
                   f"{best.name}")
        print(f"plan at the model's costs: {verdict} (τ {best.tau:.2f}, predicted {best.speedup:.2f}x)")
