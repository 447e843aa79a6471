"""`eaglet bench`: eaglet and transformers generate, in one process, on the same prompts and the
same number of new tokens (greedy, EOS ignored so every run makes exactly that many). Reports the
median tok/s over repeats, warm-up excluded, and the ratio; writes a JSON record."""
from __future__ import annotations

import statistics
import time

import torch

DEFAULT_PROMPTS = ["What is the capital of France?", "Write a short poem about autumn leaves.",
                   "Explain in two sentences why the sky is blue."]


def bench_prompts(name_or_path: str | None, n: int) -> list[str]:
    from ..datasets import load_prompts

    return (load_prompts(name_or_path) if name_or_path else DEFAULT_PROMPTS)[:n]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_runs(fn, device, repeats: int) -> list[float]:
    fn()  # warm-up, excluded
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times


def run_bench(args) -> dict:
    from ..generate import GenerationConfig, Generator
    from ..weights import load_model
    from .record import write_record

    loaded = load_model(args.model, args.dtype, args.device)
    model, tok = loaded.model, loaded.tokenizer
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    prompts = [tok.apply_chat([{"role": "user", "content": p}]) for p in bench_prompts(args.prompts, args.num_prompts)]
    n_new = args.max_new_tokens
    systems = {}

    gen = Generator(model, tok)
    cfg = GenerationConfig(max_new_tokens=n_new, ignore_eos=True)
    systems["eaglet"] = lambda ids: gen.generate([ids], cfg)[0].tokens

    if not args.no_transformers:
        from transformers import AutoModelForCausalLM

        ref = AutoModelForCausalLM.from_pretrained(str(loaded.weights_dir), dtype=dtype).to(device).eval()

        @torch.inference_mode()
        def hf(ids):
            out = ref.generate(torch.tensor([ids], device=device), max_new_tokens=n_new, min_new_tokens=n_new,
                               do_sample=False, pad_token_id=tok.hf.pad_token_id or 0)
            return out[0, len(ids):].tolist()
        systems["transformers"] = hf

    results = {}
    for name, fn in systems.items():
        per_prompt = []
        for ids in prompts:
            times = time_runs(lambda: fn(ids), device, args.repeats)
            per_prompt.append({"prompt_tokens": len(ids), "seconds": times,
                               "tok_s": n_new / statistics.median(times)})
        results[name] = {"tok_s_median": statistics.median(p["tok_s"] for p in per_prompt), "prompts": per_prompt}
    if "transformers" in results:
        results["speedup_vs_transformers"] = results["eaglet"]["tok_s_median"] / results["transformers"]["tok_s_median"]

    print(f"{'system':<14}{'tok/s (median)':>16}   device={device.type} dtype={str(dtype).split('.')[-1]} "
          f"new tokens={n_new} prompts={len(prompts)} repeats={args.repeats}")
    for name in systems:
        print(f"{name:<14}{results[name]['tok_s_median']:>16.1f}")
    if "speedup_vs_transformers" in results:
        print(f"eaglet / transformers = {results['speedup_vs_transformers']:.2f}x")
    flags = {k: v for k, v in vars(args).items() if k != "func"}
    path = write_record("bench", flags, results, args.out, models={"target": loaded.path})
    print(f"record: {path}")
    return results
