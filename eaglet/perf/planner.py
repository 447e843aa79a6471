"""The verdict: should one speculate, and how. External mode takes numbers measured on any engine;
profile mode (eaglet profile) takes eaglet's own measurements and searches chains and trees."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .cost import Costs, tau_from_positions


@dataclass
class Verdict:
    speedup: float  # predicted, with every cost counted
    ceiling: float  # the same without any draft cost: the best this verify cost allows
    break_even_tau: float  # accept length needed at this verify cost
    break_even_verify_ms: float  # verify time needed at this accept length
    pays: bool

    def lines(self, tau: float, verify_ms: float) -> list[str]:
        word = "pays" if self.pays else "loses"
        margin = (self.speedup - 1) * 100
        return [
            f"speculation {word}: predicted speedup {self.speedup:.2f}x ({margin:+.0f}% against plain decoding)",
            f"  without any draft cost the ceiling is {self.ceiling:.2f}x (accept length x decode / verify)",
            f"  break-even accept length at a {verify_ms:.1f} ms verify: {self.break_even_tau:.2f} (given {tau:.2f})",
            f"  break-even verify time at accept length {tau:.2f}: {self.break_even_verify_ms:.1f} ms "
            f"(given {verify_ms:.1f} ms)" + ("; no verify time is short enough"
                                            if self.break_even_verify_ms <= 0 else ""),
        ]


def external_verdict(decode_ms: float, verify_ms: float, draft_ms: float, tau: float, steps: int,
                     other_ms: float = 0.0) -> Verdict:
    """decode_ms: a plain decode step; verify_ms: one verify of steps+1 tokens; draft_ms: one draft
    step (the drafter runs `steps` of them); tau: measured accept length."""
    tokens = steps + 1
    c = Costs(decode_ms=decode_ms, draft_ms=draft_ms, verify_ms={tokens: verify_ms}, other_ms=other_ms)
    s = c.speedup(tau, steps, tokens)
    return Verdict(speedup=s, ceiling=tau * decode_ms / verify_ms, break_even_tau=c.break_even_tau(steps, tokens),
                   break_even_verify_ms=c.break_even_verify_ms(tau, steps), pays=s > 1.0)


@dataclass
class Candidate:
    name: str  # chain:S or tree:S,K,N (eval-draft's syntax)
    steps: int
    topk: int
    tokens: int  # verified, root included
    tau: float
    step_ms: float
    speedup: float

    def spec(self, method: str, draft: str | None):
        from ..config import SpecConfig

        if self.topk == 1:
            return SpecConfig(method, draft, steps=self.steps)
        return SpecConfig(method, draft, steps=self.steps, topk=self.topk, draft_tokens=self.tokens)


def costs_from_profile(costs: dict, other_ms: float) -> Costs:
    return Costs(decode_ms=costs["decode_ms"], draft_ms=costs["draft_ms"].get("1", 0.0),
                 verify_ms={int(k): v for k, v in costs["verify_ms"].items()}, other_ms=other_ms)


def other_ms(profile: dict, costs: dict) -> float:
    """Per-step overhead: the measured wall time of a chain step minus its modelled parts (>= 0)."""
    ch = profile["acceptance"]["chain"]
    c = costs_from_profile(costs, 0.0)
    return max(0.0, ch["step_ms_measured"] - c.step_ms(ch["steps"], ch["steps"] + 1))


def plain_host_ms(profile: dict, costs: dict) -> float:
    """Per-token time of real plain decoding beyond its forward (sampling, the sync, streaming),
    when the profile measured a plain run; 0 otherwise (older records)."""
    plain = profile["acceptance"].get("plain")
    return max(0.0, plain["step_ms_measured"] - costs["decode_ms"]) if plain else 0.0


def candidates(profile: dict, batch: int = 1) -> list[Candidate]:
    """Every chain and tree the profile can predict, with τ, step time and speedup at `batch`.
    Both sides count their host time: the speculative step through the measured overhead, plain
    decoding through its measured per-token wall time."""
    costs = next(c for c in profile["costs"] if c["batch"] == batch)
    acc_costs = next(c for c in profile["costs"] if c["batch"] == profile["acceptance_batch"])
    extra = other_ms(profile, acc_costs)
    base = costs_from_profile(costs, extra)
    base = dataclasses.replace(base, decode_ms=base.decode_ms + plain_host_ms(profile, acc_costs))
    out = []
    ch = profile["acceptance"]["chain"]
    for s in range(1, ch["steps"] + 1):
        tau = tau_from_positions(ch["accept_per_pos"], s)
        ms = base.step_ms(s, s + 1)
        out.append(Candidate(f"chain:{s}", s, 1, s + 1, tau, ms, tau * base.decode_ms / ms))
    for k, tr in profile["acceptance"]["trees"].items():
        tree_costs = dataclasses.replace(base, draft_ms=costs["draft_ms"].get(str(k), base.draft_ms))
        for key, tau in tr["tau"].items():
            s, n = (int(x) for x in key.split(","))
            if n < s + 1 or n > 1 + int(k) + (s - 1) * int(k) ** 2:
                continue
            ms = tree_costs.step_ms(s, n)
            out.append(Candidate(f"tree:{s},{k},{n}", s, int(k), n, tau, ms, tau * base.decode_ms / ms))
    return sorted(out, key=lambda c: -c.speedup)


def choose(profile: dict, batch: int = 1) -> tuple[Candidate | None, list[Candidate]]:
    """The best setting, or None when nothing beats plain decoding."""
    cands = candidates(profile, batch)
    best = cands[0] if cands and cands[0].speedup > 1.0 else None
    return best, cands


def batch_speedups(profile: dict) -> dict[int, dict[str, float]]:
    """Per measured batch size: every setting's predicted speedup over plain decoding, best first."""
    return {c["batch"]: {k.name: k.speedup for k in candidates(profile, c["batch"])} for c in profile["costs"]}


def batch_policy(profile: dict, speedups: dict[int, dict[str, float]] | None = None) -> dict[int, str | None]:
    """Per measured batch size: the setting to use (choose's: the best, where it beats plain), or None
    for plain decoding (the server's rule); from `speedups` (batch_speedups) when given."""
    speedups = batch_speedups(profile) if speedups is None else speedups
    best = {b: next(iter(s), None) for b, s in speedups.items()}  # each dict is best first
    return {b: name if name is not None and speedups[b][name] > 1.0 else None for b, name in best.items()}


def plot(profile: dict, cands: list[Candidate], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    costs = next(c for c in profile["costs"] if c["batch"] == 1)
    xs = sorted(int(k) for k in costs["verify_ms"])
    ax1.plot(xs, [costs["verify_ms"][str(x)] for x in xs], "o-", label="verify (target forward)")
    ax1.axhline(costs["decode_ms"], color="gray", ls="--", label="plain decode step")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("tokens verified in one forward")
    ax1.set_ylabel("ms")
    ax1.set_title("cost")
    ax1.legend()
    chains = sorted((c for c in cands if c.topk == 1), key=lambda c: c.steps)
    ax2.plot([c.tokens for c in chains], [c.speedup for c in chains], "o-", label="chain")
    for k in sorted({c.topk for c in cands if c.topk > 1}):
        best = {}
        for c in cands:
            if c.topk == k and (c.tokens not in best or c.speedup > best[c.tokens].speedup):
                best[c.tokens] = c
        pts = sorted(best.values(), key=lambda c: c.tokens)
        ax2.plot([c.tokens for c in pts], [c.speedup for c in pts], "s-", label=f"tree top-{k} (best depth)")
    ax2.axhline(1.0, color="red", ls="--", label="break-even")
    ax2.set_xlabel("tokens verified per step")
    ax2.set_ylabel("predicted speedup over plain")
    ax2.set_title("gain")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
