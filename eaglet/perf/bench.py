"""`eaglet bench`: systems side by side in one process, on the same prompts and the same number of
new tokens (greedy, EOS ignored so every run makes exactly that many; with --stop-at-eos replies end
at EOS and each system's tok/s counts the tokens it made):

  transformers          transformers `generate` (the baseline)
  transformers-lookup   transformers `generate` with prompt lookup (its n-gram speculation)
  plain, plain-eager    eaglet plain decoding, with CUDA graphs and without
  ngram                 eaglet n-gram speculation (chain)
  eagle3-chain          eaglet with the EAGLE-3 drafter, a chain of --chain-steps
  eagle3-tree           eaglet with the EAGLE-3 drafter, the --tree setting
  plain-sync, eagle3-chain-sync, eagle3-tree-sync
                        the same without lookahead: the host collects each step before launching
                        the next (on request only; on the CPU every system runs that way)

Per system: tok/s (median over repeats of the whole prompt set, warm-up excluded; the repeats run in
rounds, every system once per round, so a noisy machine slows all alike), τ, whether the
tokens equal eaglet plain's, and for eaglet systems the time per phase (one extra pass with CUDA
events: draft, verify, accept+commit or decode, the prompts' prefill spread over the steps, and
the rest). Ratios against eaglet plain, transformers and
the memory roofline (weight bytes over the measured copy bandwidth). Prints a table, writes one
JSON record and a PNG plot made from it.

`--shape NAME` instead measures a random-weight model of a real shape: plain decode tok/s against
the roofline, and the forward-cost curve over 1..256 tokens, eager and graphed.
"""
from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from ..args import model_kernels
from ..dist.launch import shard
from ..errors import InvalidInput

DEFAULT_PROMPTS = ["What is the capital of France?", "Write a short poem about autumn leaves.",
                   "Explain in two sentences why the sky is blue."]
DEFAULT_SYSTEMS = ("transformers", "transformers-lookup", "plain", "plain-eager", "ngram", "eagle3-chain", "eagle3-tree")
SYSTEMS = DEFAULT_SYSTEMS + ("plain-sync", "eagle3-chain-sync", "eagle3-tree-sync")
CURVE_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def bench_prompts(name_or_path: str | None, n: int) -> list[str]:
    from ..datasets import load_prompts

    return (load_prompts(name_or_path) if name_or_path else DEFAULT_PROMPTS)[:n]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def parse_tree(s: str) -> tuple[int, int, int]:
    try:
        steps, topk, n = (int(x) for x in s.split(","))
    except ValueError:
        raise InvalidInput(f"--tree wants STEPS,TOPK,TOKENS, got {s!r}") from None
    return steps, topk, n


def roofline(model, device, context: int) -> dict | None:
    """The bytes a decode step reads over the measured copy bandwidth (`ceiling_tok_s`), and the
    looser rule of every weight byte over it (`weights_ceiling_tok_s`: the input embedding table
    counted whole, no KV cache)."""
    from .shapes import copy_bandwidth, decode_bytes, weight_bytes

    if device.type != "cuda":
        return None
    bw = copy_bandwidth(device)
    nbytes, wbytes = decode_bytes(model, context), weight_bytes(model)
    return {"bandwidth_gb_s": bw / 1e9, "bytes_per_token": nbytes, "context": context, "ceiling_tok_s": bw / nbytes,
            "weight_bytes": wbytes, "weights_ceiling_tok_s": bw / wbytes}


def eaglet_systems(args, model, tok, names) -> dict:
    """name -> Generator for the eaglet systems asked for."""
    from ..config import SpecConfig
    from ..generate import Generator
    from ..spec.speculator import load_speculator

    out = {}
    graphs = not args.eager
    for name in ("plain", "plain-sync"):
        if name in names:
            out[name] = Generator(model, tok, graphs=graphs, lookahead=False if name.endswith("-sync") else None)
    if "plain-eager" in names:
        out["plain-eager"] = Generator(model, tok, graphs=False)
    if "ngram" in names:
        spec = SpecConfig("ngram", steps=args.chain_steps)
        out["ngram"] = Generator(model, tok, load_speculator(spec, model, args.model), graphs=graphs)
    if any(n.startswith("eagle3") for n in names):
        base = load_speculator(SpecConfig("eagle3", args.draft, steps=args.chain_steps), model, args.model)
        s, k, n = parse_tree(args.tree)
        tree = dataclasses.replace(base, spec=SpecConfig("eagle3", args.draft, steps=s, topk=k, draft_tokens=n))
        for name, sp in (("eagle3-chain", base), ("eagle3-tree", tree)):
            for suffix, lookahead in (("", None), ("-sync", False)):
                if name + suffix in names:
                    out[name + suffix] = Generator(model, tok, sp, graphs=graphs, lookahead=lookahead)
    return out


def run_systems(fns: dict, prompts, device, repeats: int) -> dict[str, dict]:
    """Each system's warm-up (excluded; graphs are captured here), then `repeats` rounds that time
    every system once, in turn: interleaved, so a slow spell of a shared machine falls on all
    systems alike instead of on whichever ran then."""
    for fn in fns.values():
        fn(prompts[0])
    secs: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync(device)
            t0 = time.perf_counter()
            for ids in prompts:
                fn(ids)
            sync(device)
            secs[name].append(time.perf_counter() - t0)
    return {name: {"seconds": s} for name, s in secs.items()}


def phases_pass(gen, prompts, cfg, device) -> dict:
    """One pass with a PhaseTimer: ms per step for each phase, and 'other' (the host's share)."""
    from ..runtime.timer import PhaseTimer

    timer = PhaseTimer(device)
    gen.observe(timer)  # a fresh decoder that the timer watches (graphs are captured again, untimed)
    gen.generate([prompts[0]], cfg)
    timer.reset()
    sync(device)
    t0 = time.perf_counter()
    for ids in prompts:
        gen.generate([ids], cfg)
    sync(device)
    wall_ms = (time.perf_counter() - t0) * 1e3
    totals = timer.totals()
    gen.observe(None)
    steps = max((v["count"] for k, v in totals.items() if k != "prefill"), default=0)
    if steps == 0:  # every reply ended at its first token (EOS)
        return {"steps": 0, "ms_per_step": {}}
    ms = {k: v["ms"] / steps for k, v in totals.items()}
    ms["other"] = wall_ms / steps - sum(ms.values())
    return {"steps": steps, "ms_per_step": ms}


def run_bench(args) -> dict:
    if args.shape:
        from .bench_shape import run_shape_bench
        return run_shape_bench(args)
    if getattr(args, "spec_settings", None):
        raise InvalidInput("--spec-settings times an untrained head on a --shape; give --shape")
    from ..generate import GenerationConfig
    from ..runtime.graphs import graphable
    from ..spec.metrics import SpecMetrics
    from ..weights import load_model
    from .record import write_record

    tp = shard(args)
    whole = tp is None or tp.world == 1
    # transformers holds the whole model on one device: not beside a tensor-parallel run by default
    names = args.systems or [n for n in DEFAULT_SYSTEMS if whole or not n.startswith("transformers")]
    bad = [n for n in names if n not in SYSTEMS]
    if bad:
        raise InvalidInput(f"unknown system {bad[0]!r} (choose from {', '.join(SYSTEMS)})")
    loaded = load_model(args.model, args.dtype, args.device, kernels=model_kernels(args), tp=tp)
    model, tok = loaded.model, loaded.tokenizer
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    prompts = [tok.apply_chat([{"role": "user", "content": p}]) for p in bench_prompts(args.prompts, args.num_prompts)]
    n_new = args.max_new_tokens
    cfg = GenerationConfig(max_new_tokens=n_new, ignore_eos=not args.stop_at_eos)
    gens = eaglet_systems(args, model, tok, names)

    fns, outputs, metrics = {}, {}, {}
    for name, gen in gens.items():
        def fn(ids, gen=gen, name=name):
            c = gen.generate([ids], cfg)[0]
            outputs.setdefault(name, {})[tuple(ids)] = c.tokens
            if c.spec is not None:
                metrics.setdefault(name, SpecMetrics()).merge(c.spec)
        fns[name] = fn
    if any(n.startswith("transformers") for n in names):
        from transformers import AutoModelForCausalLM

        ref = AutoModelForCausalLM.from_pretrained(str(loaded.weights_dir), dtype=dtype).to(device).eval()
        for name in ("transformers", "transformers-lookup"):
            if name in names:
                extra = {"prompt_lookup_num_tokens": args.chain_steps} if name.endswith("lookup") else {}

                @torch.inference_mode()
                def hf(ids, extra=extra, name=name):
                    if not args.stop_at_eos:
                        extra = {**extra, "min_new_tokens": n_new}
                    out = ref.generate(torch.tensor([ids], device=device), max_new_tokens=n_new, do_sample=False,
                                       pad_token_id=tok.hf.pad_token_id or 0, **extra)
                    outputs.setdefault(name, {})[tuple(ids)] = out[0, len(ids):].tolist()
                fns[name] = hf

    results: dict = {"systems": {}}
    timed = run_systems({name: fns[name] for name in names}, prompts, device, args.repeats)
    for name in names:
        r = timed[name]
        # greedy: each round makes the same tokens; at EOS a system may stop early (near-ties in bfloat16
        # can also lengthen a reply), so each counts its own
        r["new_tokens"] = sum(len(outputs[name][tuple(ids)]) for ids in prompts)
        r["tok_s"] = r["new_tokens"] / statistics.median(r["seconds"])
        if name in metrics:
            m = metrics[name]
            r["accept_length"] = m.accept_length
            r["accept_per_pos"] = m.acceptance_rate_per_pos
        if name in gens:
            r["phases"] = phases_pass(gens[name], prompts, cfg, device)
        results["systems"][name] = r
    ref_out = outputs.get("plain") or outputs.get("plain-eager")
    for name, r in results["systems"].items():
        if ref_out and name in outputs:
            same = sum(outputs[name][k] == v for k, v in ref_out.items())
            r["tokens_equal_plain"] = f"{same}/{len(ref_out)}"
    ctx = sum(map(len, prompts)) // len(prompts) + n_new // 2
    results["roofline"] = roofline(model, device, ctx)
    base = results["systems"].get("plain") or results["systems"].get("plain-eager")
    hf = results["systems"].get("transformers")
    for r in results["systems"].values():
        if base:
            r["vs_eaglet_plain"] = r["tok_s"] / base["tok_s"]
        if hf:
            r["vs_transformers"] = r["tok_s"] / hf["tok_s"]
        if results["roofline"]:
            r["vs_roofline"] = r["tok_s"] / results["roofline"]["ceiling_tok_s"]

    print_table(results, device, dtype, n_new, len(prompts), args.repeats, args.stop_at_eos)
    flags = {k: v for k, v in vars(args).items() if k != "func"}
    flags["cuda_graphs"] = device.type == "cuda" and not args.eager and graphable(loaded.model)
    flags["kernels"] = dataclasses.asdict(loaded.model.kernels)
    path = write_record("bench", flags, results, args.out, models={"target": loaded.path, "drafter": args.draft})
    png = plot_bench(results, path.with_suffix(".png"))
    print(f"record: {path}\nplot: {png}")
    return results


def print_table(results, device, dtype, n_new, n_prompts, repeats, stop_at_eos: bool = False) -> None:
    print(f"device={device.type} dtype={str(dtype).split('.')[-1]} new tokens={n_new}"
          f"{' (or up to EOS)' if stop_at_eos else ''} prompts={n_prompts} repeats={repeats}")
    print(f"{'system':<22}{'tok/s':>9}{'τ':>6}{'x plain':>9}{'x HF':>8}{'x roof':>8}  same   "
          f"{'ms/step: draft':>15}{'verify':>8}{'accept':>8}{'decode':>8}{'prefill':>8}{'other':>8}")
    for name, r in results["systems"].items():
        ph = r.get("phases", {}).get("ms_per_step", {})
        cell = lambda k: f"{ph[k]:8.3f}" if k in ph else f"{'':8}"  # noqa: E731
        ratio = lambda k, w, d: f"{r[k]:{w}.{d}f}" if k in r else f"{'-':>{w}}"  # noqa: E731
        print(f"{name:<22}{r['tok_s']:9.1f}{r.get('accept_length', 1.0):6.2f}{ratio('vs_eaglet_plain', 9, 2)}"
              f"{ratio('vs_transformers', 8, 2)}{ratio('vs_roofline', 8, 3)}  {r.get('tokens_equal_plain', '-'):<6}"
              f"{cell('draft'):>15}{cell('verify')}{cell('accept')}{cell('decode')}{cell('prefill')}{cell('other')}")
    if results.get("roofline"):
        rf = results["roofline"]
        print(f"roofline: {rf['bytes_per_token'] / 1e6:.1f} MB per token at {rf['bandwidth_gb_s']:.0f} GB/s "
              f"-> {rf['ceiling_tok_s']:.0f} tok/s")


def plot_bench(results: dict, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["systems"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 0.5 * len(names) + 2))
    a.barh(names, [results["systems"][n]["tok_s"] for n in names], color="tab:blue")
    a.set_xlabel("tok/s (median)")
    a.invert_yaxis()
    left = [0.0] * len(names)
    for phase, color in (("draft", "tab:orange"), ("verify", "tab:green"), ("accept", "tab:red"),
                         ("decode", "tab:purple"), ("prefill", "tab:brown"), ("other", "tab:gray")):
        vals = []
        for n in names:
            r = results["systems"][n]
            ph = r.get("phases", {}).get("ms_per_step", {})
            vals.append(max(0.0, ph.get(phase, 0.0)) / r.get("accept_length", 1.0))
        b.barh(names, vals, left=left, color=color, label=phase)
        left = [x + y for x, y in zip(left, vals)]
    b.set_xlabel("ms per generated token, by phase")
    b.invert_yaxis()
    b.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
