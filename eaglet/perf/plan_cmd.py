"""`eaglet profile` and `eaglet plan --profile`: measure, predict, choose, and check the choice."""
from __future__ import annotations

import time
from pathlib import Path

from ..config import SpecConfig
from ..args import model_kernels
from ..dist.launch import shard
from ..errors import InvalidInput
from .compare import load_record
from .planner import Candidate, batch_policy, choose, plot
from .record import write_record


def parse_tree(text: str) -> tuple[int, int, int]:
    try:
        s, k, n = (int(x) for x in text.split(","))
    except ValueError:
        raise InvalidInput(f"bad tree {text!r}: expected STEPS,TOPK,TOKENS") from None
    SpecConfig("ngram", steps=s, topk=k, draft_tokens=n)  # validates the shape
    return s, k, n


def load_target_and_drafter(model: str | None, dtype, device, method: str, draft: str | None, steps: int,
                            kernels=None, tp=None):
    from ..spec.speculator import load_speculator
    from ..weights import load_model

    loaded = load_model(model, dtype, device, kernels=kernels, tp=tp)
    base = load_speculator(SpecConfig(method, draft, steps=steps), loaded.model,
                           None if model is None else loaded.path)
    return loaded, base


def spread(items: list, n: int) -> list:
    """n items spread evenly over the list (all of them when n covers it), in order."""
    if n >= len(items):
        return list(items)
    return [items[i * len(items) // n] for i in range(max(n, 0))]


def chat_prompts(tok, name: str, n: int) -> list[list[int]]:
    """n prompts of the set, spread over it: MT-bench lists its categories one after another and
    its first 8 are all writing prompts, on which an H200 profile measured τ 1.92
    for a chain of 7 (profile-gpu-20261130-202027.json) where all 80 give 2.68 for a chain of 5."""
    from ..datasets import load_prompts

    return [tok.apply_chat([{"role": "user", "content": p}]) for p in spread(load_prompts(name), n)]


def run_profile(args) -> int:
    from .profile import measure_acceptance, measure_costs

    trees = [parse_tree(t) for t in args.trees]
    SpecConfig(args.spec, args.draft, steps=args.chain_steps)
    batch_sizes = sorted(set(args.batch_sizes) | {args.batch})
    loaded, base = load_target_and_drafter(args.model, args.dtype, args.device, args.spec, args.draft,
                                           args.chain_steps, model_kernels(args), shard(args))
    prompts = chat_prompts(loaded.tokenizer, args.prompts, args.num_prompts)
    topks = tuple(sorted({1} | {k for _, k, _ in trees}))
    costs = []
    for b in batch_sizes:
        costs.append(measure_costs(loaded.model, base, b, args.context, topks, args.chain_steps))
        c = costs[-1]
        print(f"batch {b}: decode {c['decode_ms']:.2f} ms | verify " + " ".join(
            f"{n}:{v:.1f}" for n, v in c["verify_ms"].items()) + " ms | draft level " + " ".join(
            f"top{k}:{v:.2f}" for k, v in c["draft_ms"].items()) + " ms")
    acc = measure_acceptance(loaded.model, loaded.tokenizer, base, prompts, args.max_new_tokens, args.batch,
                             args.chain_steps, trees)
    rates = " ".join(f"{a:.2f}" for a in acc["chain"]["accept_per_pos"])
    print(f"chain of {args.chain_steps}: accept length {acc['chain']['accept_length']:.2f}, per position {rates}")
    for k, tr in acc["trees"].items():
        print(f"tree {tr['steps']},{k},{tr['draft_tokens']}: accept length {tr['accept_length']:.2f}")
    flags = {k: v for k, v in vars(args).items()}
    results = {"costs": costs, "acceptance": acc, "acceptance_batch": args.batch}
    path = write_record("profile", flags, results, args.out,
                        models={"target": loaded.path, "drafter": base.draft_path})
    print(f"record: {path}")
    return 0


def measured_speedups(loaded, base, specs: list[SpecConfig], prompts, max_new: int, batch: int,
                      repeats: int = 2) -> list[float]:
    """Per spec: median over repeats of (plain wall time / speculative wall time) on the same prompts;
    plain and speculative runs alternate so drifts in machine speed hit both alike."""
    import dataclasses
    import statistics

    from ..generate import GenerationConfig, Generator

    cfg = GenerationConfig(max_new_tokens=max_new)
    gens = [Generator(loaded.model, loaded.tokenizer)] + [
        Generator(loaded.model, loaded.tokenizer, dataclasses.replace(base, spec=s)) for s in specs]

    def run(gen):
        t0 = time.perf_counter()
        for i in range(0, len(prompts), batch):
            gen.generate(prompts[i:i + batch], cfg)
        return time.perf_counter() - t0

    for g in gens:  # warm-up, excluded
        g.generate(prompts[:1], GenerationConfig(max_new_tokens=8))
    ratios: list[list[float]] = [[] for _ in specs]
    for _ in range(repeats):
        plain = run(gens[0])
        for i, g in enumerate(gens[1:]):
            ratios[i].append(plain / run(g))
    return [statistics.median(r) for r in ratios]


def neighbours(best: Candidate, cands: list[Candidate]) -> list[Candidate]:
    """The chosen setting and its neighbours the profile predicts: one step shallower and deeper
    (chains), the next smaller and larger verify budget at the same depth and top-k (trees)."""
    if best.topk == 1:
        near = [c for c in cands if c.topk == 1 and abs(c.steps - best.steps) == 1]
    else:
        same = sorted((c for c in cands if (c.steps, c.topk) == (best.steps, best.topk)), key=lambda c: c.tokens)
        i = next(j for j, c in enumerate(same) if c.name == best.name)
        near = same[max(0, i - 1):i] + same[i + 1:i + 2]
    return [best] + near


def plan_from_profile(args) -> int:
    rec = load_record(args.profile)
    if rec.get("kind") != "profile":
        raise InvalidInput(f"{args.profile}: not a profile record (kind {rec.get('kind')!r})")
    prof = rec["results"]
    if args.batch_size not in [c["batch"] for c in prof["costs"]]:
        raise InvalidInput(f"the profile measured batch sizes {[c['batch'] for c in prof['costs']]}, "
                           f"not {args.batch_size}")
    best, cands = choose(prof, args.batch_size)
    decode = next(c for c in prof["costs"] if c["batch"] == args.batch_size)["decode_ms"]
    print(f"{'setting':<18}{'accept length':>14}{'step ms':>10}{'break-even τ':>14}{'predicted':>11}")
    for c in cands[:12]:
        print(f"{c.name:<18}{c.tau:>14.2f}{c.step_ms:>10.2f}{c.step_ms / decode:>14.2f}{c.speedup:>10.2f}x")
    if best:
        print(f"plan: speculate with {best.name} (predicted {best.speedup:.2f}x at batch {args.batch_size})")
    else:
        top = cands[0]
        print(f"plan: don't speculate at batch {args.batch_size}: the best setting, {top.name}, is predicted at "
              f"{top.speedup:.2f}x; it would need accept length {top.step_ms / decode:.2f} (has {top.tau:.2f})")
    policy = batch_policy(prof)
    print("batch policy: " + ", ".join(f"{b}: {s or 'plain'}" for b, s in sorted(policy.items())))
    png = Path(args.plot) if args.plot else Path(args.profile).with_suffix(".plan.png")
    plot(prof, cands, png)
    print(f"plot: {png}")
    results = {"choice": best.name if best else None, "batch_size": args.batch_size, "policy": policy,
               "candidates": [vars(c) for c in cands]}
    if args.validate:
        flags = rec["flags"]
        loaded, base = load_target_and_drafter(flags["model"], flags["dtype"], flags["device"], flags["spec"],
                                               flags["draft"], flags["chain_steps"])
        prompts = chat_prompts(loaded.tokenizer, flags["prompts"], flags["num_prompts"])
        settings = neighbours(best or cands[0], cands)
        if args.validate_all:
            trees = {f"tree:{t['steps']},{k},{t['draft_tokens']}" for k, t in prof["acceptance"]["trees"].items()}
            chains = {f"chain:{s}" for s in range(1, prof["acceptance"]["chain"]["steps"] + 1)}
            settings += [c for c in cands if c.name in chains | trees and c not in settings]
        measured = measured_speedups(loaded, base, [c.spec(flags["spec"], flags["draft"]) for c in settings], prompts,
                                     flags["max_new_tokens"], args.batch_size)
        rows = []
        print(f"{'setting':<18}{'predicted':>10}{'measured':>10}{'error':>8}")
        for c, got in zip(settings, measured):
            rows.append({"setting": c.name, "predicted": c.speedup, "measured": got, "error": c.speedup / got - 1})
            print(f"{c.name:<18}{c.speedup:>9.2f}x{got:>9.2f}x{c.speedup / got - 1:>+8.1%}")
        best_measured = max(rows, key=lambda r: r["measured"])
        chosen = rows[0]["measured"]
        print(f"best measured: {best_measured['setting']} ({best_measured['measured']:.2f}x); the choice "
              f"{rows[0]['setting']} is {chosen / best_measured['measured'] - 1:+.1%} from it; "
              f"{sum(abs(r['error']) <= 0.10 for r in rows)} of {len(rows)} settings predicted within ±10%")
        results["validation"] = rows
    path = write_record("plan", {**vars(args), "profile_record": str(args.profile)}, results,
                        Path(args.profile).parent)
    print(f"record: {path}")
    return 0
