"""The `eaglet` command: one entry point, one subcommand per job.

Every EagletError (and a missing file) becomes one line on stderr and exit status 1; argparse
reports bad flags itself with status 2. No traceback reaches the user for bad input.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import TYPE_CHECKING

from .args import add_model_args, add_sampling_args, add_spec_args, model_kernels, spec_config
from .dist.bench_comm import add_parser as add_bench_comm_parser
from .dist.bench_comm import cmd_bench_comm
from .dist.commands import add_env_parser, cmd_env
from .dist.launch import COMMANDS as TP_COMMANDS
from .dist.launch import add_tp_args, launch, shard
from .errors import EagletError, InvalidInput
from .perf.bench_moe import add_parser as add_bench_moe_parser
from .perf.bench_moe import cmd_bench_moe
from .server.commands import add_serve_parsers, cmd_bench_serve, cmd_serve
from .train.commands import add_train_parsers, cmd_data, cmd_eval_draft, cmd_train_draft

if TYPE_CHECKING:
    from .generate import Generator


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eaglet",
                                     description="Speculative decoding for Llama-family, MoE and MLA models.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt, streaming it",
                       description="Generate text from a prompt; prints the text as it streams, then a "
                                   "stats line (prompt tokens, new tokens, seconds, tok/s) on stderr.")
    g.add_argument("prompt", help="the prompt text ('-' reads it from stdin)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn with the chat template")
    g.add_argument("--system", help="system message for --chat")
    g.add_argument("--compare-plain", action="store_true",
                   help="afterwards, run plain decoding on the same prompt and print the speedup")
    g.add_argument("--eager", action="store_true", help="no CUDA graphs (they are used on the GPU by default)")
    add_model_args(g)
    add_tp_args(g)
    add_sampling_args(g)
    add_spec_args(g)

    b = sub.add_parser("bench", help="eaglet vs transformers, plain vs speculative, side by side",
                       description="Measure systems side by side in one process on the same prompts (greedy, "
                                   "EOS ignored unless --stop-at-eos): transformers generate (plain and prompt lookup), eaglet plain "
                                   "(graphed and eager), n-gram, EAGLE-3 chain and tree. Prints tok/s, τ, ratios "
                                   "(vs eaglet plain, transformers, the memory roofline) and time per phase; writes "
                                   "a JSON record and a PNG. --shape measures a random-weight model of a real shape.")
    add_model_args(b)
    add_tp_args(b)
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--stop-at-eos", action="store_true",
                   help="end each reply at EOS (as served replies and speculative-decoding benchmarks do) and "
                        "count the tokens each system made; default: every reply runs --max-new-tokens")
    b.add_argument("--prompts", help="mtbench, humaneval, sharegpt, a ShareGPT .json file, or a JSONL file with "
                                     "a 'prompt' field per line (default: 3 built-in chat prompts)")
    b.add_argument("--num-prompts", type=int, default=3)
    b.add_argument("--repeats", type=int, default=3, help="timed repeats of the prompt set (median reported)")
    b.add_argument("--systems", nargs="+", metavar="NAME",
                   help="any of: transformers transformers-lookup plain plain-eager ngram eagle3-chain "
                        "eagle3-tree (the default: all of these), and plain-sync eagle3-chain-sync "
                        "eagle3-tree-sync (no lookahead: the host collects each step before the next)")
    b.add_argument("--draft", help="EAGLE-3 drafter directory (default: the bundled one of the default model)")
    b.add_argument("--chain-steps", type=int, default=5, help="draft steps of the chains (and lookup tokens)")
    b.add_argument("--tree", default="6,8,32", help="STEPS,TOPK,TOKENS of eagle3-tree")
    b.add_argument("--eager", action="store_true", help="no CUDA graphs for eaglet systems")
    b.add_argument("--spec-settings", nargs="+", metavar="SETTING",
                   help="with --shape: the speculation settings timed with an untrained EAGLE-3 head, chain:STEPS "
                        "or tree:STEPS,TOPK,TOKENS (default: chain:3 and the --tree setting)")
    b.add_argument("--shape", help="random weights of a real shape (eaglet/perf/shapes.py): llama-3.1-8b, "
                                  "llama-3.1-70b, qwen3-8b, smollm2-135m, qwen3-30b-a3b, qwen3-235b-a22b, "
                                  "mixtral-8x7b, deepseek-v2-lite, kimi-k2 (a slice)")
    b.add_argument("--context", type=int, default=512, help="with --shape: committed tokens before decoding")
    b.add_argument("--out", default="bench/results", help="directory for the JSON record")
    add_train_parsers(sub)
    pr = sub.add_parser("profile", help="measure decode, draft and verify costs and acceptance per depth",
                        description="Measure what the cost model needs for this target and drafter: the plain "
                                    "decode step, one draft level, the verify-cost curve, per-step overhead, and "
                                    "acceptance per depth (chains) and per ranked node (trees). Writes a record "
                                    "that `eaglet plan --profile` reads.")
    add_model_args(pr)
    add_tp_args(pr)
    pr.add_argument("--spec", choices=["eagle3", "ngram", "draft"], default="eagle3")
    pr.add_argument("--draft", help="drafter (default: the bundled drafter of the default model)")
    pr.add_argument("--prompts", default="mtbench", help="mtbench, humaneval, sharegpt, a ShareGPT .json file "
                                                         "or a JSONL file (--num-prompts spread over the set)")
    pr.add_argument("--num-prompts", type=int, default=8)
    pr.add_argument("--max-new-tokens", type=int, default=128)
    pr.add_argument("--batch", type=int, default=1, help="rows per generate call while measuring acceptance")
    pr.add_argument("--batch-sizes", type=int, nargs="+", default=[1], help="batch sizes to measure costs at")
    pr.add_argument("--context", type=int, default=256, help="committed tokens when timing decode/verify")
    pr.add_argument("--chain-steps", type=int, default=7)
    pr.add_argument("--trees", nargs="*", default=["7,4,64"], help="measured trees STEPS,TOPK,TOKENS; smaller "
                                                                    "trees of the same top-k are predicted from them")
    pr.add_argument("--out", default="bench/results")

    pl = sub.add_parser("plan", help="should this deployment speculate, and how?",
                        description="The cost model S = accept length x T_decode / (T_draft + T_verify + T_other). "
                                    "With --profile: picks chain/tree settings per batch size from an `eaglet "
                                    "profile` record (or says don't speculate), plots cost and gain curves, and "
                                    "with --validate measures the choice and its neighbours. With --shape or --model "
                                    "and --tp/--gpu/--link: a deployment's decode and verify costs from its bytes and "
                                    "all-reduces, break-even accept lengths, the best chain; with --verify-ms too, "
                                    "where another engine's time goes. Otherwise: the verdict for numbers measured "
                                    "on any engine.")
    pl.add_argument("--profile", help="record written by `eaglet profile`")
    pl.add_argument("--batch-size", type=int, default=1, help="with --profile: the batch size to plan for")
    pl.add_argument("--plot", help="with --profile: PNG of cost and gain curves (default next to the record)")
    pl.add_argument("--validate", action="store_true",
                    help="with --profile: run the chosen and neighbouring settings and print predicted vs measured")
    pl.add_argument("--validate-all", action="store_true",
                    help="with --validate: also every chain up to the profiled depth and every profiled tree")
    pl.add_argument("--decode-ms", type=float, help="one plain decode step")
    pl.add_argument("--verify-ms", type=float, help="one verify forward of steps+1 tokens")
    pl.add_argument("--draft-ms", type=float, help="one draft step (default: 0, the ceiling; with --shape/--model "
                                                   "an estimate of an EAGLE-3 head's step)")
    pl.add_argument("--other-ms", type=float, default=0.0, help="accept/commit/bookkeeping per step")
    pl.add_argument("--steps", type=int, help="draft steps per verify (chain length)")
    pl.add_argument("--accept-len", type=float, help="measured accept length (tokens per verify, bonus counted)")
    pl.add_argument("--metrics-url", help="read the accept length from a running SGLang / vLLM / eaglet server's "
                                          "/metrics")
    pl.add_argument("--json", action="store_true", help="print the verdict as JSON")
    from .perf.plan_deploy import add_args as add_deployment_args

    add_deployment_args(pl)

    cp = sub.add_parser("compare", help="every difference between two JSON records, next to the result deltas",
                        description="List every difference in flags, environment and model files between two "
                                    "records (bench, eval-draft, ...), next to the change in their numeric results.")
    cp.add_argument("a")
    cp.add_argument("b")
    cp.add_argument("--json", action="store_true")
    add_serve_parsers(sub)
    add_bench_moe_parser(sub)
    add_env_parser(sub)
    add_bench_comm_parser(sub)
    return parser


def cmd_generate(args) -> int:
    spec_config(args, args.model)  # bad flags: one error here, not one a worker
    return generate(args)


def generate(args) -> int:
    from .generate import GenerationConfig, Generator
    from .sampling import SamplingParams
    from .weights import load_model

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, stop=tuple(args.stop),
                           sampling=SamplingParams(args.temperature, args.top_k, args.top_p, args.seed))
    spec = spec_config(args, args.model)  # flags are checked before the (slow) model load
    loaded = load_model(args.model, args.dtype, args.device, kernels=model_kernels(args), tp=shard(args))
    tok = loaded.tokenizer
    if tok is None:
        raise EagletError(f"{loaded.path}: the model directory has no tokenizer files")
    speculator = None
    if spec is not None:
        from .spec.speculator import load_speculator

        speculator = load_speculator(spec, loaded.model, None if args.model is None else loaded.path)
    if args.chat:
        msgs = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": prompt}]
        ids = tok.apply_chat(msgs)
    else:
        ids = tok.encode(prompt)
    generator = Generator(loaded.model, tok, speculator, graphs=not args.eager)
    t0 = time.perf_counter()
    n = 0

    def show(ev):
        nonlocal n
        n += 1
        print(ev.text, end="", flush=True)

    [out] = generator.generate([ids], gen, on_event=show)
    dt = time.perf_counter() - t0
    print()
    stats = f"[eaglet] prompt tokens {len(ids)} | new tokens {n} | {dt:.2f} s | {n / dt:.1f} tok/s"
    if out.spec is not None:
        stats += f" | {spec.method} accept length {out.spec.accept_length:.2f}"
    print(stats, file=sys.stderr)
    if args.compare_plain and speculator is not None:
        compare_plain(generator, Generator(loaded.model, tok, graphs=not args.eager), ids, gen, out.tokens)
    return 0


def compare_plain(spec: Generator, plain: Generator, ids: list[int], gen, spec_tokens: list[int],
                  repeats: int = 3) -> None:
    """Speculative against plain decoding of the same prompt: after a plain warm-up, `repeats` runs
    of each, alternating (both see the same machine load); median tok/s of each."""
    import statistics

    [ref] = plain.generate([ids], gen)
    rates: dict[str, list[float]] = {"spec": [], "plain": []}
    for _ in range(repeats):
        for name, g in (("spec", spec), ("plain", plain)):
            t0 = time.perf_counter()
            [c] = g.generate([ids], gen)
            rates[name].append(len(c.tokens) / (time.perf_counter() - t0))
    s, p = statistics.median(rates["spec"]), statistics.median(rates["plain"])
    same = "same tokens" if ref.tokens == spec_tokens else "different tokens (sampling)"
    print(f"[eaglet] speculative {s:.1f} tok/s, plain {p:.1f} tok/s ({same}; medians of {repeats} alternating runs) "
          f"| speculative speedup {s / p:.2f}x", file=sys.stderr)


def cmd_bench(args) -> int:
    from .perf.bench import run_bench

    run_bench(args)
    return 0


def cmd_plan(args) -> int:
    if args.profile:
        from .perf.plan_cmd import plan_from_profile

        return plan_from_profile(args)
    if args.shape or args.model:
        from .perf.plan_deploy import plan_deployment

        return plan_deployment(args)
    if args.gpu or args.link or args.comm:
        raise InvalidInput("--gpu, --link and --comm describe a deployment: give --shape or --model too")
    from .perf.external import accept_length_from_metrics, fetch_metrics
    from .perf.planner import external_verdict

    missing = [f for f in ("decode_ms", "verify_ms", "steps") if getattr(args, f) is None]
    if missing or (args.accept_len is None) == (args.metrics_url is None):
        raise InvalidInput("external mode needs --decode-ms, --verify-ms, --steps and one of --accept-len / "
                           "--metrics-url (or give --profile)")
    if not args.decode_ms > 0 or not args.verify_ms > 0:
        raise InvalidInput("--decode-ms and --verify-ms must be positive")
    draft_ms = 0.0 if args.draft_ms is None else args.draft_ms
    if draft_ms < 0 or args.other_ms < 0 or args.steps < 1:
        raise InvalidInput("--draft-ms and --other-ms must be >= 0 and --steps >= 1")
    source = "--accept-len"
    tau = args.accept_len
    if args.metrics_url:
        tau, source = accept_length_from_metrics(fetch_metrics(args.metrics_url))
    if not 1.0 <= tau <= args.steps + 1:
        raise InvalidInput(f"accept length {tau} is outside [1, steps + 1 = {args.steps + 1}]")
    v = external_verdict(args.decode_ms, args.verify_ms, draft_ms, tau, args.steps, args.other_ms)
    if args.json:
        print(json.dumps({**vars(v), "accept_length": tau, "accept_length_source": source, "inputs": vars(args)}))
    else:
        print("\n".join(v.lines(tau, args.verify_ms)))
        if args.metrics_url:
            print(f"  accept length {tau:.2f} read from {source}")
    return 0


def cmd_profile(args) -> int:
    from .perf.plan_cmd import run_profile

    return run_profile(args)


def cmd_compare(args) -> int:
    from .perf.compare import compare, load_record, render

    c = compare(load_record(args.a), load_record(args.b))
    print(json.dumps(c, default=str) if args.json else render(c, args.a, args.b))
    return 0



COMMANDS = {"generate": cmd_generate, "bench": cmd_bench, "data": cmd_data, "train-draft": cmd_train_draft,
            "eval-draft": cmd_eval_draft, "plan": cmd_plan, "compare": cmd_compare,
            "profile": cmd_profile, "serve": cmd_serve, "bench-serve": cmd_bench_serve,
            "bench-moe": cmd_bench_moe, "env": cmd_env, "bench-comm": cmd_bench_comm}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        out = getattr(args, "out", None)  # every --out names a directory: refuse a file before any work
        if isinstance(out, str) and os.path.exists(out) and not os.path.isdir(out):
            raise InvalidInput(f"--out {out}: exists and is not a directory")
        name = args.command.replace("_", "-")
        if name in TP_COMMANDS and args.tp != 1 and getattr(args, "shard", None) is None:
            return launch(args, COMMANDS[name])  # workers, each running the command on its slice
        return COMMANDS[name](args)
    except EagletError as e:
        print(f"eaglet: error: {e}", file=sys.stderr)
        return 1
    except FileNotFoundError as e:
        print(f"eaglet: error: {e.filename or e}: no such file", file=sys.stderr)
        return 1
    except OSError as e:  # permissions, a full disk, a file where a directory should be
        print(f"eaglet: error: {e.filename + ': ' if e.filename else ''}{e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\neaglet: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stdout = open(os.devnull, "w")
        return 0


if __name__ == "__main__":
    sys.exit(main())
