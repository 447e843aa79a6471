"""Where a graphed decoding step of SmolLM2 spends its GPU time: the kernels of plain decoding and
of an EAGLE-3 chain step, per step (count and microseconds, from torch.profiler's CUDA activity,
which sees the kernels inside CUDA graph replays), against the wall time per step; then, phase by
phase (decode; draft, verify, accept), every kernel of one captured graph, from replaying that
graph alone; and per step the GPU's busy time (the union of its kernels) against the span they
cover, with the host's time in cudaGraphLaunch: where a step's wall time exceeds its kernels'. A
probe for choosing what to fuse next, not part of the package.

  python3 bench/gpu/step_profile.py MODEL.gguf DRAFTER_DIR OUT_DIR [TREE ...]   # TREE: STEPS,TOPK,TOKENS;
      # each tree is profiled beside plain and the chain of 5 (e.g. 5,4,16 6,8,32)
  python3 bench/gpu/step_profile.py --shape llama-3.1-8b OUT_DIR   # plain decoding of a random-weight
      # shape (eaglet bench --shape's model, context 512): where a step short of the roofline goes
  python3 bench/gpu/step_profile.py --forward llama-3.1-8b OUT_DIR [1,2,16]  # bench --shape's graphed
      # forward of T tokens, kernel by kernel for each T: what a verify of 16 adds to a decode step
"""
import re
import sys
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from eaglet.config import SpecConfig
from eaglet.generate import GenerationConfig, Generator
from eaglet.perf.record import write_record
from eaglet.spec.speculator import load_speculator
from eaglet.weights import load_model

# nvjet: cuBLASLt's Hopper GEMMs; attend_kernel: eaglet's cache-attention kernel; aten::*mm: CPU operators
KINDS = [("gemm", r"gemm|gemv|cutlass|sm90_xmma|cublas|splitk|nvjet|aten::(add|b)?mm\b"),
         ("attention", r"fmha|flash|attention|sdpa|cudnn|^attend_kernel"),
         ("triton (compiled)", r"^triton_"), ("copy/index", r"index|scatter|gather|copy|cat|memcpy"),
         ("reduce", r"reduce|argmax|max|sum|topk|sort")]


def kind_of(name: str) -> str:
    for k, pat in KINDS:
        if re.search(pat, name, re.I):
            return k
    return "other elementwise"


def kernel_table(prof, per: int) -> list[tuple[str, float, float]]:
    """(name, count, µs) of every CUDA kernel the profiler saw, divided by `per`, costliest first."""
    kernels = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name][0] += 1
            kernels[e.name][1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    return sorted(((n, c / per, us / per) for n, (c, us) in kernels.items()), key=lambda r: -r[2])


def phase_graphs(gen, reps: int = 20) -> dict:
    """Every kernel of one captured graph per phase of `gen`'s decoder (the first key captured),
    replayed alone `reps` times after its runs: which phase launches what. Replays only repeat a
    finished step's work (rows at their token limit do not move), so nothing grows."""
    out = {}
    runner = gen.decoder_in_use().graphs  # the decoder of the last generate() call
    for key, (g, _) in list(runner.graphs.items()):
        phase = str(key[0])
        if phase in out:
            continue
        g.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                g.replay()
            torch.cuda.synchronize()
        rows = kernel_table(prof, reps)
        out[phase] = {"key": repr(key), "kernels": sum(r[1] for r in rows), "gpu_us": sum(r[2] for r in rows),
                      "all": [{"name": n[:160], "count": c, "us": us} for n, c, us in rows]}
    return out


def busy_and_launches(prof) -> tuple[float, float, float, int]:
    """From one profiled generate call: the GPU's busy time (the union of its kernels' intervals),
    the span from the first kernel's start to the last one's end, and the host's time in
    cudaGraphLaunch (µs, with the number of launches): how much of a step the GPU sits idle, and
    whether launching graphs could be why."""
    spans, launch_us, launches = [], 0.0, 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            spans.append((e.time_range.start, e.time_range.end))
        elif "cudaGraphLaunch" in e.name:
            launch_us += e.time_range.end - e.time_range.start
            launches += 1
    spans.sort()
    busy, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy, (spans[-1][1] - spans[0][0]) if spans else 0.0, launch_us, launches


def idle_by_transition(prof, reps: int) -> dict:
    """Per replay of one graph profiled `reps` times: the span from its first kernel's start to its
    last one's end, the kernels' summed time, and the idle time between consecutive kernels summed
    by (kernel before, kernel after), costliest first: whether a slower wall comes from the kernels
    or from the gaps between them (µs)."""
    ks = sorted((e.time_range.start, e.time_range.end, e.name[:40]) for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA)
    n = len(ks) // reps
    span = busy = 0.0
    idle = defaultdict(float)
    for r in range(reps):
        seq = ks[r * n:(r + 1) * n]
        span += seq[-1][1] - seq[0][0]
        busy += sum(b - a for a, b, _ in seq)
        for (_, a1, an), (b0, _, bn) in zip(seq, seq[1:]):
            idle[f"{an} -> {bn}"] += max(0.0, b0 - a1)
    return {"kernels": n, "span_us": span / reps, "kernel_us": busy / reps, "idle_us": (span - busy) / reps,
            "idle_by_transition": {k: v / reps for k, v in sorted(idle.items(), key=lambda kv: -kv[1])}}


def profile_system(gen, ids, cfg, steps_of) -> dict:
    gen.generate([ids], cfg)  # warm-up: graphs captured
    gen.generate([ids], cfg)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = gen.generate([ids], cfg)[0]
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        gen.generate([ids], cfg)
        torch.cuda.synchronize()
    steps = steps_of(out)
    rows = kernel_table(prof, steps)
    busy, first_to_last, launch_us, launches = busy_and_launches(prof)
    return {"steps": steps, "wall_ms_per_step": wall * 1e3 / steps,
            "gpu_us_per_step": sum(r[2] for r in rows), "kernels_per_step": sum(r[1] for r in rows),
            "gpu_busy_us_per_step": busy / steps, "gpu_first_to_last_us_per_step": first_to_last / steps,
            "graph_launch_host_us_per_step": launch_us / steps, "graph_launches_per_step": launches / steps,
            **summary(rows)}


def summary(rows: list[tuple[str, float, float]], top: int | None = None) -> dict:
    """by_kind (kernels, µs per step, costliest kind first) and the `top` rows of a kernel table."""
    by_kind = defaultdict(lambda: [0.0, 0.0])
    for n, c, us in rows:
        by_kind[kind_of(n)][0] += c
        by_kind[kind_of(n)][1] += us
    return {"by_kind": {k: {"kernels": c, "us": us} for k, (c, us) in sorted(by_kind.items(), key=lambda x: -x[1][1])},
            "top": [{"name": n[:160], "per_step": c, "us": us} for n, c, us in rows[:top]]}


def print_summary(r: dict, top: int = 12) -> None:
    for k, v in r["by_kind"].items():
        print(f"  {k:<20}{v['kernels']:7.1f} kernels {v['us']:8.1f} us")
    for t in r["top"][:top]:
        print(f"    {t['per_step']:6.1f} x {t['us'] / max(t['per_step'], 1e-9):6.2f} us  {t['name']}")


def setup(model_path: str, draft: str):
    """SmolLM2 in bfloat16 on the GPU, one chat prompt, 128 new tokens, the EAGLE-3 chain of 5 (shared
    with host_profile.py): (loaded model, prompt ids, GenerationConfig, Speculator)."""
    loaded = load_model(model_path, "bfloat16", "cuda")
    ids = loaded.tokenizer.apply_chat([{"role": "user", "content": "Explain in two sentences why the sky is blue."}])
    cfg = GenerationConfig(max_new_tokens=128, ignore_eos=True)
    return loaded, ids, cfg, load_speculator(SpecConfig("eagle3", draft, steps=5), loaded.model, model_path)


def generators(loaded, sp, model_path: str, draft: str, trees: list[str]) -> dict[str, Generator]:
    """plain, the EAGLE-3 chain of 5 (`sp`) and each tree STEPS,TOPK,TOKENS, by name (shared with
    host_profile.py)."""
    model, tok = loaded.model, loaded.tokenizer
    gens = {"plain": Generator(model, tok), "eagle3-chain5": Generator(model, tok, sp)}
    for t in trees:
        steps, topk, tokens = map(int, t.split(","))
        spec = SpecConfig("eagle3", draft, steps=steps, topk=topk, draft_tokens=tokens)
        gens[f"eagle3-tree{steps}-{topk}-{tokens}"] = Generator(model, tok, load_speculator(spec, model, model_path))
    return gens


def main(model_path: str, draft: str, out_dir: str, trees: list[str]) -> None:
    loaded, ids, cfg, sp = setup(model_path, draft)
    gens = generators(loaded, sp, model_path, draft, trees)
    results = {name: profile_system(g, ids, cfg, (lambda c: len(c.tokens) - 1) if name == "plain" else
                                    (lambda c: c.spec.drafts)) for name, g in gens.items()}
    phases = {name: phase_graphs(g) for name, g in gens.items()}
    for name, by_phase in phases.items():
        results[name]["phase_graphs"] = by_phase
        for phase, r in by_phase.items():
            print(f"{name} graph {phase}: {r['kernels']:.0f} kernels, {r['gpu_us']:.0f} us GPU ({r['key']})")
    for name, r in results.items():
        print(f"{name}: {r['steps']} steps, wall {r['wall_ms_per_step']:.3f} ms/step, GPU {r['gpu_us_per_step']:.0f} us "
              f"in {r['kernels_per_step']:.0f} kernels per step; GPU busy {r['gpu_busy_us_per_step']:.0f} of "
              f"{r['gpu_first_to_last_us_per_step']:.0f} us (first kernel to last), cudaGraphLaunch "
              f"{r['graph_launch_host_us_per_step']:.0f} us host in {r['graph_launches_per_step']:.1f} launches")
        print_summary(r)
    path = write_record("step-profile", {"model": model_path, "draft": draft, "max_new_tokens": 128, "trees": trees},
                        results, out_dir,
                        models={"target": loaded.path, "drafter": draft})
    print(f"record: {path}")


def main_shape(shape: str, out_dir: str, context: int = 512) -> None:
    """Plain decoding of a random-weight model of `shape`, kernel by kernel, with the GEMMs' share of
    the step set against the bytes a step reads (the roofline's weights) and the measured copy
    bandwidth."""
    from eaglet.perf.bench import roofline
    from eaglet.perf.shapes import decode_bytes, random_model

    model = random_model(shape, torch.device("cuda"), torch.bfloat16)
    prompt = torch.randint(0, model.config.vocab_size, (context,), generator=torch.Generator().manual_seed(1)).tolist()
    cfg = GenerationConfig(max_new_tokens=128, ignore_eos=True)
    gen = Generator(model, None)
    r = profile_system(gen, prompt, cfg, lambda c: len(c.tokens) - 1)
    r["phase_graphs"] = phase_graphs(gen)
    rf = r["roofline"] = roofline(model, torch.device("cuda"), context + 64)  # as bench --shape: mid-generation
    gemm_us = r["by_kind"].get("gemm", {}).get("us", 0.0)
    r["roofline_us"] = 1e6 / rf["ceiling_tok_s"]
    r["gemm_bytes_s"] = decode_bytes(model, 0) / (gemm_us * 1e-6) if gemm_us else None  # weights over GEMM time
    print(f"{shape}: wall {r['wall_ms_per_step']:.3f} ms/step, GPU {r['gpu_us_per_step']:.0f} us in "
          f"{r['kernels_per_step']:.0f} kernels; roofline {r['roofline_us']:.0f} us "
          f"({rf['bytes_per_token'] / 1e9:.2f} GB at {rf['bandwidth_gb_s'] / 1e3:.2f} TB/s); GEMMs {gemm_us:.0f} us"
          + (f" = {r['gemm_bytes_s'] / 1e12:.2f} TB/s of weights" if gemm_us else ""))
    print_summary(r, top=20)
    path = write_record("step-profile", {"shape": shape, "context": context, "max_new_tokens": 128}, {"plain": r},
                        out_dir)
    print(f"record: {path}")


@torch.inference_mode()
def main_forward(shape: str, out_dir: str, tokens: tuple[int, ...] = (1, 2, 16), context: int = 576,
                 reps: int = 20) -> None:
    """The graphed forward of T tokens of `bench --shape`'s curve (its context: 512 + 64), each T's
    kernels from `reps` replays, and the kernels that grow most from the first T to the last."""
    from eaglet.perf.curves import forward_steps, time_ms
    from eaglet.perf.shapes import random_model

    model = random_model(shape, torch.device("cuda"), torch.bfloat16)
    tables, timing = {}, {}
    for t, step in forward_steps(model, tokens, context, graphs=True):
        event_ms = time_ms(step, torch.device("cuda"), 50)  # as bench --shape times it, no profiler
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                step()
                torch.cuda.synchronize()  # replays apart: one replay's gaps are its own
        rows = kernel_table(prof, reps)
        tables[t] = {n: (c, us) for n, c, us in rows}
        timing[t] = {"event_ms": event_ms, **idle_by_transition(prof, reps)}
        tm = timing[t]
        print(f"T={t}: {sum(r[2] for r in rows):.0f} us in {sum(r[1] for r in rows):.0f} kernels; CUDA events "
              f"{event_ms * 1e3:.0f} us a replay; profiled: first kernel to last {tm['span_us']:.0f} us, kernels "
              f"{tm['kernel_us']:.0f}, idle between them {tm['idle_us']:.0f}", flush=True)
        for k, us in list(tm["idle_by_transition"].items())[:8]:
            print(f"    idle {us:7.1f} us  {k}")
        print_summary(summary(rows), top=10)
    lo, hi = tables[tokens[0]], tables[tokens[-1]]
    grew = sorted(((n, hi.get(n, (0, 0.0)), lo.get(n, (0, 0.0))) for n in set(lo) | set(hi)),
                  key=lambda r: -(r[1][1] - r[2][1]))
    print(f"grew most from T={tokens[0]} to T={tokens[-1]} (count, us at each):")
    for n, (c1, u1), (c0, u0) in grew[:15]:
        print(f"  {u1 - u0:+8.1f} us  {c0:5.1f} x {u0:7.1f} -> {c1:5.1f} x {u1:7.1f}  {n[:110]}")
    results = {str(t): {"gpu_us": sum(us for _, us in tab.values()), "kernels": sum(c for c, _ in tab.values()),
                        **timing[t], "all": [{"name": n[:160], "count": c, "us": us} for n, (c, us) in tab.items()]}
               for t, tab in tables.items()}
    print(f"record: {write_record('forward-profile', {'shape': shape, 'context': context, 'tokens': list(tokens)}, results, out_dir)}")


if __name__ == "__main__":
    if sys.argv[1] == "--shape":
        main_shape(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "--forward":
        main_forward(sys.argv[2], sys.argv[3], tuple(map(int, sys.argv[4].split(","))) if len(sys.argv) > 4 else (1, 2, 16))
    else:
        main(*sys.argv[1:4], sys.argv[4:])
