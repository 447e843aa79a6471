"""Data regeneration's host path on the GPU: Generator.generate with text (each token detokenized
as it comes, what `eaglet data` and `eaglet eval-draft` did) against tokens only (text=False, what
they do now), at data regeneration's batch, greedy, side by side in one run: a warm-up call that
captures every graph, then the two in alternating order, medians; the tokens must be the same.

  python3 bench/gpu/regen_host.py MODEL.gguf OUT_DIR [--batch 2048] [--max-new-tokens 320] [--repeats 2]

Prompts: the MT-bench and HumanEval prompts (chat template applied), repeated to fill the batch.
"""
import argparse
import statistics
import time

import torch

from eaglet.datasets import load_prompts
from eaglet.generate import GenerationConfig, Generator
from eaglet.perf.record import write_record
from eaglet.weights import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--max-new-tokens", type=int, default=320)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    loaded = load_model(args.model, "bfloat16", "cuda")
    tok = loaded.tokenizer
    ids = [tok.apply_chat([{"role": "user", "content": t}]) for t in load_prompts("mtbench") + load_prompts("humaneval")]
    prompts = [ids[i % len(ids)] for i in range(args.batch)]
    gen, cfg = Generator(loaded.model, tok), GenerationConfig(max_new_tokens=args.max_new_tokens)

    def run(text: bool):
        torch.cuda.synchronize()  # host sync: the timed span starts and ends with the GPU idle
        t0 = time.perf_counter()
        out = gen.generate(prompts, cfg, text=text)
        torch.cuda.synchronize()
        return [c.tokens for c in out], time.perf_counter() - t0

    ref, warm = run(False)
    seconds, same = {"text": [], "tokens_only": []}, True
    for r in range(args.repeats):
        order = [("text", True), ("tokens_only", False)]
        for name, text in order if r % 2 == 0 else order[::-1]:
            toks, dt = run(text)
            seconds[name].append(dt)
            same &= toks == ref
    new_tokens, steps = sum(map(len, ref)), max(map(len, ref))
    results = {"rows": args.batch, "new_tokens": new_tokens, "steps": steps, "warmup_s": warm, "same_tokens": same}
    for name, ts in seconds.items():
        med = statistics.median(ts)
        results[name] = {"seconds": ts, "median_s": med, "tokens_per_s": new_tokens / med, "ms_per_step": 1e3 * med / steps}
    results["tokens_only_speedup"] = results["text"]["median_s"] / results["tokens_only"]["median_s"]
    path = write_record("regen-host", vars(args), results, args.out, models={"target": args.model})
    print({k: v for k, v in results.items()}, "\nrecord:", path)


if __name__ == "__main__":
    main()
