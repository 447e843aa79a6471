"""How many tokens a second `eaglet serve`'s host path can hand out under load, when the model
costs nothing: SmolLM2 on the CPU with every graph-runner step body run once per row bucket (a
prefill once) and its outputs returned after that (host_overhead.py's replay_free), so a step
costs only the host's work: the decoder's bookkeeping, the Batcher (stopping, detokenizing), the
engine's chunks, the event loop's SSE events. Each system is served in this process (uvicorn,
uvloop + httptools, in a thread); `eaglet bench-serve` drives it from its own process (128-token
ShareGPT requests, EOS ignored; a warm-up run, then ROUNDS timed ones). On the H200 most of a
loaded server's step is not the GPU's (BENCHMARKS.md, Serving); this is the host's
part alone, plain against speculation settings. A probe, CPU; its host is not the GPU machine's.
With --pyspy, py-spy samples the server through one more run of each system (raw stacks in --out).

  .venv/bin/python bench/cpu/serve_host_load.py [--systems plain tree:4,4,16 chain:4] [--concurrency 64] [--multi-step 1 4]
      [--spec-multi-step 1 2]
"""
import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from host_overhead import replay_free  # noqa: E402
from inprocess import bench_serve, serving  # noqa: E402

from eaglet.config import SpecConfig  # noqa: E402
from eaglet.generate import Generator  # noqa: E402
from eaglet.runtime.plain import PlainStep  # noqa: E402
from eaglet.spec.loop import SpecStep  # noqa: E402
from eaglet.perf.record import write_record  # noqa: E402
from eaglet.runtime.graphs import GraphRunner  # noqa: E402
from eaglet.server.app import build_app, make_engine  # noqa: E402
from eaglet.server.policy import setting_spec  # noqa: E402
from eaglet.spec.speculator import bundled_drafter, load_speculator  # noqa: E402
from eaglet.weights import load_model  # noqa: E402


def replay_any_shape(self, key, body, graph=True):
    """replay_free with the attention span left out of a step's key, and a prefill's outputs (its
    first tokens) made once and repeated for any number of prompts of any length: a real forward
    on the CPU for each new span, prompt count or length would be most of the run."""
    if key[0] != "prefill":
        return replay_free(self, (*key[:2], key[-1]), body, graph)  # (phase, rows, step name)
    first = replay_free(self, (key[0], key[-1]), body, graph)  # ("prefill", prompts, length, step name)
    return first[:1].repeat(key[1])


def live_rows_only(cls, count: int | None = None) -> None:
    """replay_free hands every step the first step's output, which would emit tokens to rows freed
    since (on the device their limit of 0 freezes them): the probe counts a row's tokens only while
    the host has it live, as the device's limit would. `count`: each speculating row emits that many
    tokens a step (the first step's count would hold for the whole run)."""
    inner = cls.collect

    def collect(step, rows, same, live, observer):
        if count is not None:
            rows = [[min(count, step.tokens_per_step), *r[1:]] for r in rows]
        return inner(step, rows, [ok and bool(on) for ok, on in zip(same, live)], live, observer)
    cls.collect = collect


def model_without_cost(tokens_per_step: int):
    """SmolLM2 on the CPU (one thread) with every step body run once per key and its outputs returned
    after that, speculating rows emitting `tokens_per_step` tokens a step: (loaded model, the bundled
    EAGLE-3 speculator), what the host-path probes serve or step."""
    torch.set_num_threads(1)
    GraphRunner.run = replay_any_shape
    live_rows_only(PlainStep)
    live_rows_only(SpecStep, tokens_per_step)
    loaded = load_model(None, "float32", "cpu")
    return loaded, load_speculator(SpecConfig("eagle3", str(bundled_drafter())), loaded.model)


def warm_replay_free(engine) -> None:
    """Every row bucket's one real step of every setting the engine's policy can choose, before any
    timing (replay_any_shape keeps what it makes; the engine reuses it)."""
    with torch.inference_mode():
        for setting in engine.settings():
            dec = engine.decoder()
            dec.use(engine.step(setting))
            dec.graphs.enabled = True  # warmup() is for graphs
            dec.warmup(prompt_tokens=16)
            dec.graphs.enabled = False


def replay_free_engine(name: str, tokens_per_step: int, rows: int, multi_step: int | None):
    """The probe's engine for system `name`, warmed: what an engine process builds
    (server/remote.py's factory, so a module-level function)."""
    loaded, base = model_without_cost(tokens_per_step)
    engine = make_engine(Generator(loaded.model, loaded.tokenizer, system(base, name)), "m", max_batch=rows,
                         max_len=1024, multi_step=multi_step)
    warm_replay_free(engine)
    return engine


def system(base, name: str):
    """The speculator of a system named plain (None), chain:S or tree:S,K,N."""
    return None if name == "plain" else dataclasses.replace(base, spec=setting_spec(name, base.spec))


def bench(port: int, args) -> dict:
    rec = bench_serve(port, args.prompts, args.num_requests, args.concurrency)
    return {"output_tok_s": rec["output_throughput"], "tpot_ms_median": rec["tpot_ms"]["median"],
            "itl_ms_median": rec["itl_ms"]["median"], "accept_length": rec["accept_length"]}


def decode_cost(tok, calls: int = 20000) -> dict:
    """What one incremental detokenization costs (TextStream decodes a window of 1-4 ids a token):
    transformers' decode against the fast tokenizer's core, which eaglet's Tokenizer calls."""
    ids = tok.encode("The quick brown fox jumps over the lazy dog, héllo wörld 🦅, and then some more words.")
    windows = [ids[i:i + 1 + i % 4] for i in range(len(ids) - 4)]
    out = {}
    for name, fn in (("transformers", lambda w: tok.hf.decode(w, skip_special_tokens=True)),
                     ("core", lambda w: tok.hf.backend_tokenizer.decode(w, skip_special_tokens=True))):
        t = time.perf_counter()
        for i in range(calls):
            fn(windows[i % len(windows)])
        out[name] = (time.perf_counter() - t) / calls * 1e6
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--systems", nargs="+", default=["plain", "tree:4,4,16", "chain:4"])
    ap.add_argument("--prompts", default=".gpudata/sharegpt_first_turns.json")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens-per-step", type=int, default=3, help="what each speculating row emits a step "
                    "(the served τ on the H200 was ~3)")
    ap.add_argument("--multi-step", type=int, nargs="+", default=[1], help="serve each system with each "
                    "(steps a host round trip)")
    ap.add_argument("--spec-multi-step", type=int, nargs="+", default=[1], help="serve each speculating system "
                    "with each of these speculation steps a host round trip (serve --spec-multi-step)")
    ap.add_argument("--pyspy", action="store_true")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    loaded, base = model_without_cost(args.tokens_per_step)
    results = {"decode_us": decode_cost(loaded.tokenizer)}
    print("decode of a 1-4 token window, µs a call: " + ", ".join(f"{k} {v:.2f}" for k, v in results["decode_us"].items()))
    runs = [(s, m, sm) for s in args.systems for m in args.multi_step
            for sm in (args.spec_multi_step if s != "plain" else [1])]
    for port, (sysname, multi, spec_multi) in enumerate(runs, start=8091):
        name = sysname + ("" if args.multi_step == [1] else f" x{multi}") + ("" if spec_multi == 1 else f" s{spec_multi}")
        gen = Generator(loaded.model, loaded.tokenizer, system(base, sysname))
        app = build_app(gen, "m", max_batch=args.concurrency, max_len=1024, multi_step=multi,
                        spec_multi_step=spec_multi)
        warm_replay_free(app.state.engine)
        with serving(app, port):
            rounds = [bench(port, args) for _ in range(args.rounds + 1)][1:]  # the first warms up
            if args.pyspy:
                Path(args.out).mkdir(parents=True, exist_ok=True)  # py-spy does not make it
                raw = Path(args.out) / f"serve-host-load-{name.replace(':', '-').replace(',', '-').replace(' ', '-')}.pyspy.txt"
                spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "-p", str(os.getpid()),
                                        "--threads", "-r", "200", "-d", "8", "-f", "raw", "-o", str(raw)],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                bench(port, args)
                spy.wait()
        tok_s = statistics.median(r["output_tok_s"] for r in rounds)
        results[name] = {"rounds": rounds, "output_tok_s_median": tok_s}
        print(f"{name:<14} {tok_s:8.0f} tok/s (rounds " + " ".join(f"{r['output_tok_s']:.0f}" for r in rounds)
              + f"), TPOT {statistics.median(r['tpot_ms_median'] for r in rounds):.2f} ms, "
              f"ITL {statistics.median(r['itl_ms_median'] for r in rounds):.2f} ms, "
              f"accept length {rounds[-1]['accept_length']}", flush=True)
    print("record:", write_record("serve-host-load", vars(args), results, args.out,
                                  models={"target": loaded.path, "drafter": str(bundled_drafter())}))


if __name__ == "__main__":
    main()
