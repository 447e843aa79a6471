"""Diagnosis of numbers measured on another engine against the step model (perf/step_model.py): how
much of a decode and of a verify the bytes and the all-reduces explain, what is left, the usual
causes of an excess with the eaglet command that checks each, and what would make speculation win."""
from __future__ import annotations

from dataclasses import dataclass

from .planner import Verdict, external_verdict
from .step_model import BF16, Deployment, step_time


@dataclass
class Share:
    """One measured forward split by the model: bytes over bandwidth, all-reduces, the fixed cost
    solved from the decode step (0 for the decode itself), and what is left."""
    tokens: int
    measured_ms: float
    bytes_ms: float
    comm_ms: float
    fixed_ms: float

    @property
    def left_ms(self) -> float:
        return self.measured_ms - self.bytes_ms - self.comm_ms - self.fixed_ms


@dataclass
class Cause:
    name: str
    why: str
    check: str  # the eaglet command that measures it


@dataclass
class Diagnosis:
    decode: Share
    verify: Share
    model_verify_ms: float  # the model's verify: bytes + all-reduces + the fixed cost of the decode
    explained_ms: float  # of verify - decode: what the bytes and all-reduces add
    overhead_ms: float  # of verify - decode: the rest
    verdict: Verdict  # today's numbers
    at_model: Verdict  # today's accept length, the verify at the model's cost
    causes: list[Cause]

    @property
    def excess_ms(self) -> float:
        return self.verify.measured_ms - self.decode.measured_ms


def diagnose(d: Deployment, decode_ms: float, verify_ms: float, steps: int, tau: float, draft_ms: float,
             other_ms: float, target: str, moe_shape: str | None) -> Diagnosis:
    """`d` calibrated on `decode_ms` (its fixed cost solved from it); the verify is a chain's, steps + 1
    tokens. `target` names the model in the commands (`--shape NAME` or `--model DIR`), `moe_shape` a
    shape of its MoE layers' size for bench-moe."""
    one, many = step_time(d, 1), step_time(d, steps + 1)
    dec = Share(1, decode_ms, one.bytes_ms, one.comm_ms, 0.0)
    ver = Share(steps + 1, verify_ms, many.bytes_ms, many.comm_ms, d.fixed_ms)
    explained = (many.bytes_ms - one.bytes_ms) + (many.comm_ms - one.comm_ms)
    return Diagnosis(dec, ver, many.ms, explained, verify_ms - decode_ms - explained,
                     external_verdict(decode_ms, verify_ms, draft_ms, tau, steps, other_ms),
                     external_verdict(decode_ms, many.ms, draft_ms, tau, steps, other_ms),
                     causes(d, steps + 1, target, moe_shape))


def causes(d: Deployment, tokens: int, target: str, moe_shape: str | None) -> list[Cause]:
    """The usual reasons a verify of `tokens` costs more than its bytes and all-reduces, each with the
    command that checks it here."""
    h, n = d.config.hidden_size, d.tp
    small, big = h * BF16, tokens * h * BF16
    out = [
        Cause("verify outside CUDA graphs",
              f"a decode step is captured, a verify of {tokens} tokens may not be (or only piecewise, its "
              f"attention eager between graphs): every layer's launches and host work come back",
              f"eaglet bench {target} --context {d.context}  (forward ms graphed against eager at each token count)"),
    ]
    if d.config.moe is not None:
        fmt = d.experts[0] if d.experts else "bf16"
        cmd = (f"eaglet bench-moe --shape {moe_shape} --quant {fmt} --tokens 1 {tokens} --tune" if moe_shape else
               "eaglet bench-moe --shape NAME --tune  (add a shape of this model's MoE size to eaglet/perf/shapes.py)")
        out.append(Cause("MoE kernels untuned for few tokens",
                         f"tiles chosen for one token or for large batches: {tokens} tokens should read about "
                         f"{step_time(d, tokens).bytes.experts:.0f} experts a layer, yet may run far from that floor",
                         f"{cmd}  (each path against the touched-bytes floor)"))
    out.append(Cause("few-token paths off the decode's",
                     f"a forward of {tokens} tokens leaves the one-row kernels a decode runs (GEMV, a dot for a "
                     f"float32 router) for tile GEMMs, and layout copies appear: a fixed extra a step, 0.3-1.1 ms "
                     f"on eaglet's own MoE shapes on the H200, 4.6 over Kimi-K2's 61 layers (BENCHMARKS.md, Planner)",
                     f"python3 bench/gpu/step_profile.py --forward {moe_shape or 'SHAPE'} OUT 1,2,{tokens}  "
                     f"(kernel by kernel, what a verify adds to a decode)"))
    out.append(Cause("host syncs in the step",
                     "a .item()/.cpu() in the verify step (metadata built on the host, acceptance read back) "
                     "stalls the GPU until the host catches up",
                     f"eaglet profile {target if target.startswith('--model') else '--model DIR'} --tp {n} "
                     f"--chain-steps {tokens - 1}  (per-step host overhead beside the forward times)"))
    if n > 1:
        out.append(Cause("NCCL protocol change at a message size",
                         f"a verify's all-reduces carry {big / 1024:.0f} KiB against a decode's {small / 1024:.0f} "
                         f"KiB; NCCL may switch protocol (LL, LL128, Simple) or algorithm between them",
                         f"eaglet bench-comm --tp {n} --hidden {h} --tokens 1 {tokens} --nccl-env NCCL_PROTO=LL  "
                         f"(and without --nccl-env: the latency at both sizes)"))
        out.append(Cause("settings that did not reach the workers",
                         "NCCL_* or graph settings exported in one shell but not in the workers' environment",
                         f"eaglet env --tp {n}  (every worker's NCCL settings at communicator creation)"))
    return out


def lines(g: Diagnosis, tau: float, steps: int) -> list[str]:
    dec, ver = g.decode, g.verify
    share = g.overhead_ms / g.excess_ms if g.excess_ms > 0 else 0.0
    out = [f"{'where the time goes':<22}{'measured':>10}{'bytes':>9}{'all-red.':>10}{'fixed':>9}{'left':>9}  ms"]
    for name, s in (("decode, 1 token", dec), (f"verify, {ver.tokens} tokens", ver)):
        out.append(f"{name:<22}{s.measured_ms:10.2f}{s.bytes_ms:9.2f}{s.comm_ms:10.2f}{s.fixed_ms:9.2f}"
                   f"{s.left_ms:9.2f}")
    out += [
        f"  the decode's fixed cost (all it does beyond bytes and all-reduces) is carried into the verify: "
        f"the model's verify is {g.model_verify_ms:.2f} ms",
        f"  the verify costs {g.excess_ms:.2f} ms more than a decode: bytes and all-reduces explain "
        f"{g.explained_ms:.2f} ms, {g.overhead_ms:.2f} ms ({share:.0%}) is overhead beyond them",
    ]
    if g.verify.left_ms > 0.1 * g.verify.measured_ms:
        out.append("  usual causes of such an excess, and the command that checks each:")
        for c in g.causes:
            out += [f"  - {c.name}: {c.why}", f"      {c.check}"]
    out += [
        "what would make speculation win:",
        f"  at today's verify ({ver.measured_ms:.1f} ms) the accept length must reach "
        f"{g.verdict.break_even_tau:.2f} (today {tau:.2f}, chain of {steps})",
        f"  at today's accept length, a verify at the model's {g.model_verify_ms:.1f} ms would give "
        f"{g.at_model.speedup:.2f}x (today {g.verdict.speedup:.2f}x)",
    ]
    return out
