"""`eaglet bench --shape NAME`: a random-weight model of a real shape, measured as a target. Plain
decode against the roofline (the bytes a step reads over the measured copy bandwidth: for MoE, the
experts actually routed to), the cost of one forward over T = 1..256 tokens (a verify of T draft
nodes) with the distinct experts a layer touched and the bytes ratio each forward would cost at a
decode step's efficiency, speculation with an untrained EAGLE-3 head (τ about 1: what a
speculation step costs; its tokens checked against plain decoding's and graphed against eager),
and transformers' own model of the same tensors decoding beside it. A sliced shape (kimi-k2: its
dense first layer and three MoE layers) is also timed with one MoE layer only; the difference
gives the cost of one MoE layer, and the whole model's figures follow from its layer count."""
from __future__ import annotations

import dataclasses
import statistics

import torch

from ..args import model_kernels
from .bench import CURVE_TOKENS, parse_tree, roofline, run_systems


def bytes_ratios(model, context: int, experts: dict | None) -> dict[str, float]:
    """{str(T): bytes a forward of T tokens reads / a decode step's}: the cost a forward would have
    at a decode step's efficiency; for MoE, with the distinct experts measured a layer."""
    from .shapes import decode_bytes

    one = decode_bytes(model, context, 1, experts["1"] if experts else None)
    return {str(t): decode_bytes(model, context, t, experts[str(t)] if experts else None) / one for t in CURVE_TOKENS}


def decode_steps(whole: list[float], first: list[float], n_new: int) -> dict:
    """What a decode step costs without the prefill: the generation of `n_new` tokens less the prefill
    and its first token, timed in the same rounds (paired, the median over rounds), per step. The
    roofline counts one step's bytes, so this is the figure to hold against it; `tok_s` (the whole
    generation over its tokens) also carries the prefill, which reads every expert of an MoE model."""
    if n_new < 2:
        return {}
    step = statistics.median((w - f) / (n_new - 1) for w, f in zip(whole, first))
    return {"first_token_s": statistics.median(first), "step_ms": step * 1e3, "steps_tok_s": 1 / step}


def spec_settings(args) -> dict:
    """{record name: SpecConfig} of the settings `--spec-settings` names (default: chain 3 and --tree):
    eagle3-chainS, eagle3-treeS,K,N."""
    from .eval_draft import parse_setting

    s, k, n = parse_tree(args.tree)
    names = getattr(args, "spec_settings", None) or ["chain:3", f"tree:{s},{k},{n}"]
    out = {}
    for name in names:
        spec = parse_setting(name, "eagle3", None)
        out[f"eagle3-{name.replace(':', '')}"] = spec
    return out


def speculation_costs(model, prompt: list[int], cfg, device, repeats: int, settings: dict, graphs: bool,
                      plain: list[int] | None = None) -> dict:
    """Each of `settings` (spec_settings) with an untrained EAGLE-3 head of the target's shape: tok/s,
    τ and milliseconds a speculation step (draft, verify, accept), the prompt generated `repeats`
    times after a warm-up; whether its tokens equal plain decoding's (`plain`) and, graphed, the
    same setting's eager run."""
    from ..generate import Generator
    from ..spec.speculator import Speculator
    from .shapes import random_head

    head = random_head(model)
    out = {}
    for name, spec in settings.items():
        gen = Generator(model, None, Speculator(spec, head=head), graphs=graphs)
        seen = []
        r = run_systems({name: lambda ids, gen=gen: seen.append(gen.generate([ids], cfg)[0])},
                        [prompt], device, repeats)[name]
        secs, m = statistics.median(r["seconds"]), seen[-1].spec
        out[name] = {"tok_s": cfg.max_new_tokens / secs, "accept_length": m.accept_length, "steps": m.drafts,
                     "ms_per_step": secs * 1e3 / max(m.drafts, 1), **r}
        if plain is not None:
            out[name]["equals_plain"] = seen[-1].tokens == plain
        gen.fresh()
        if graphs:
            eager = Generator(model, None, Speculator(spec, head=head), graphs=False)
            out[name]["graphed_equals_eager"] = eager.generate([prompt], cfg)[0].tokens == seen[-1].tokens
            eager.fresh()
    return out


def transformers_decode(model, prompt: list[int], n_new: int, device, repeats: int) -> dict:
    """transformers' own model holding the same tensors (perf/hf_twin.py), greedy `generate` of n_new
    tokens after the prompt: its tok/s. It routes as its router says (the benchmark spread is
    eaglet's only), which for a decode step reads the same k experts a layer."""
    from .hf_twin import hf_twin

    hf = hf_twin(model)
    ids = torch.tensor([prompt], device=device)

    @torch.inference_mode()
    def run(_):
        hf.generate(ids, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False, pad_token_id=0)
    r = run_systems({"transformers": run}, [prompt], device, repeats)["transformers"]
    return {"tok_s": n_new / statistics.median(r["seconds"]), **r}


def slice_figures(model, curve: dict, context: int, graphs: bool, layers: int) -> dict:
    """For a sliced shape (its dense layers and a few MoE layers of a `layers`-layer model): the
    forward curve again with a single MoE layer; their difference over the MoE layers removed is one
    MoE layer's cost, the rest (embedding, dense layers, output layer) the base; the whole model's
    forward is base + its MoE layers x one layer's cost."""
    from ..models.moe import SparseMoE
    from .curves import forward_curve

    stack = model.model.layers
    sparse = [i for i, layer in enumerate(stack) if isinstance(layer.ffn, SparseMoE)]
    model.model.layers = stack[:sparse[0] + 1]  # the cache keeps every layer's room: the first ones used
    try:
        one = forward_curve(model, CURVE_TOKENS, context, graphs)
    finally:
        model.model.layers = stack
    removed = len(sparse) - 1
    per_layer = {t: (curve[t] - one[t]) / removed for t in curve}
    base = {t: one[t] - per_layer[t] for t in curve}
    whole_moe = layers - (len(stack) - len(sparse))
    whole = {t: base[t] + whole_moe * per_layer[t] for t in curve}
    return {"one_moe_layer_ms": one, "moe_layer_ms": per_layer, "base_ms": base, "layers": layers,
            "whole_ms": whole, "whole_decode_tok_s": 1e3 / whole["1"]}


def run_shape_bench(args) -> dict:
    from ..generate import GenerationConfig, Generator
    from ..weights.loader import resolve_device, resolve_dtype
    from .curves import forward_curve
    from .record import write_record
    from .shapes import SLICES, random_model

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    settings = spec_settings(args)  # (bad input named before a model of tens of GB is built)
    from ..dist.launch import shard

    tp = shard(args)
    model = random_model(args.shape, device, dtype, kernels=model_kernels(args, device), tp=tp)
    ctx = args.context
    prompt = torch.randint(0, model.config.vocab_size, (ctx,), generator=torch.Generator().manual_seed(1)).tolist()
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    first = GenerationConfig(max_new_tokens=1, ignore_eos=True)  # the prefill and its token, timed beside
    results: dict = {"shape": args.shape, "context": ctx, "decode": {}, "forward_ms": {}}
    modes = {"eager": False} if device.type != "cuda" or args.eager else {"eager": False, "graphed": True}
    plain_tokens: dict = {}
    for mode, graphs in modes.items():
        gen = Generator(model, None, graphs=graphs)
        def run(ids, gen=gen, mode=mode):
            plain_tokens[mode] = gen.generate([ids], cfg)[0].tokens
        timed = run_systems({mode: run, "first": lambda ids, gen=gen: gen.generate([ids], first)}, [prompt],
                            device, args.repeats)
        r = timed[mode]
        results["decode"][mode] = {"tok_s": args.max_new_tokens / statistics.median(r["seconds"]), **r,
                                   **decode_steps(r["seconds"], timed["first"]["seconds"], args.max_new_tokens)}
        gen.fresh()  # free its cache before the curve allocates one
        experts: dict = {}
        results["forward_ms"][mode] = forward_curve(model, CURVE_TOKENS, ctx + args.max_new_tokens // 2, graphs,
                                                    experts=experts)
        if experts:
            results["experts"] = experts
    if tp is None or tp.world == 1:  # (transformers' model of one rank's slice would mean nothing)
        try:
            results["decode"]["transformers"] = transformers_decode(model, prompt, args.max_new_tokens, device,
                                                                    args.repeats)
        except torch.OutOfMemoryError as e:  # its forward's own buffers beside eaglet's model: recorded, not fatal
            results["transformers_skipped"] = f"out of memory: {str(e).splitlines()[0]}"
            torch.cuda.empty_cache()
    if "transformers" in results["decode"]:
        for mode in modes:
            results["decode"][mode]["vs_transformers"] = (results["decode"][mode]["tok_s"]
                                                          / results["decode"]["transformers"]["tok_s"])
    best_mode = "graphed" if "graphed" in modes else "eager"
    if "graphed" in modes:
        results["decode"]["graphed"]["equals_eager"] = plain_tokens["graphed"] == plain_tokens["eager"]
    results["speculation"] = speculation_costs(model, prompt, cfg, device, args.repeats, settings,
                                               graphs=modes[best_mode], plain=plain_tokens[best_mode])
    if args.shape in SLICES:
        results["slice"] = slice_figures(model, results["forward_ms"][best_mode], ctx + args.max_new_tokens // 2,
                                         modes[best_mode], SLICES[args.shape])
    results["roofline"] = roofline(model, device, ctx + args.max_new_tokens // 2)
    best = results["forward_ms"][best_mode]
    results["verify_over_decode"] = {t: best[t] / best["1"] for t in best}
    results["bytes_ratio"] = bytes_ratios(model, ctx + args.max_new_tokens // 2, results.get("experts"))
    if results["roofline"]:
        for mode, d in results["decode"].items():
            if mode == "transformers":
                continue
            d["vs_roofline"] = d["tok_s"] / results["roofline"]["ceiling_tok_s"]
            if "steps_tok_s" in d:
                d["steps_vs_roofline"] = d["steps_tok_s"] / results["roofline"]["ceiling_tok_s"]
            d["vs_weights_ceiling"] = d["tok_s"] / results["roofline"]["weights_ceiling_tok_s"]
            results["forward_ms"][mode + "_vs_roofline_1tok"] = (
                1e3 / results["roofline"]["ceiling_tok_s"]) / results["forward_ms"][mode]["1"]
    print_shape(args, dtype, results, modes)
    flags = {k: v for k, v in vars(args).items() if k != "func"}
    flags["cuda_graphs"] = "graphed" in modes
    flags["kernels"] = dataclasses.asdict(model.kernels)
    path = write_record(f"bench-shape-{args.shape}", flags, results, args.out)
    print(f"record: {path}")
    return results


def print_shape(args, dtype, results: dict, modes: dict) -> None:
    print(f"shape {args.shape}, {str(dtype).split('.')[-1]}, batch 1, context {args.context}")
    for mode, d in results["decode"].items():
        rf = results["roofline"] if mode != "transformers" else None
        roof = (f"  ({d['vs_roofline']:.1%} of the {rf['ceiling_tok_s']:.0f} tok/s roofline; "
                f"{d['vs_weights_ceiling']:.1%} of all weight bytes at that bandwidth, {rf['weights_ceiling_tok_s']:.0f})"
                if rf else "")
        vs = f", {d['vs_transformers']:.2f}x transformers" if "vs_transformers" in d else ""
        print(f"plain decode, {mode:<12}{d['tok_s']:8.1f} tok/s{vs}{roof}")
        if "step_ms" in d:
            of = f", {d['steps_vs_roofline']:.1%} of the roofline" if "steps_vs_roofline" in d else ""
            print(f"  a step after the first token {d['step_ms']:.3f} ms ({d['steps_tok_s']:.1f} tok/s{of}); "
                  f"the prefill and its token {d['first_token_s'] * 1e3:.1f} ms")
    moe = "experts" in results
    sliced = results.get("slice")
    print(f"{'tokens':>8}" + "".join(f"{m + ' ms':>14}" for m in modes) + f"{'x decode':>10}"
          + (f"{'experts':>9}" if moe else "") + f"{'x bytes':>9}"
          + (f"{'MoE layer ms':>14}{'whole ms':>11}" if sliced else ""))
    for t in map(str, CURVE_TOKENS):
        print(f"{t:>8}" + "".join(f"{results['forward_ms'][m][t]:14.3f}" for m in modes)
              + f"{results['verify_over_decode'][t]:10.2f}" + (f"{results['experts'][t]:9.1f}" if moe else "")
              + f"{results['bytes_ratio'][t]:9.2f}"
              + (f"{sliced['moe_layer_ms'][t]:14.3f}{sliced['whole_ms'][t]:11.2f}" if sliced else ""))
    if sliced:
        print(f"the whole model ({sliced['layers']} layers) from the slice: {sliced['whole_decode_tok_s']:.1f} tok/s")
    for name, r in results["speculation"].items():
        checks = "".join(f", {k.replace('_', ' ')}: {r[k]}" for k in ("equals_plain", "graphed_equals_eager") if k in r)
        print(f"{name} (untrained head): {r['tok_s']:.1f} tok/s, τ {r['accept_length']:.2f}, "
              f"{r['ms_per_step']:.3f} ms a step{checks}")
