"""How many kernels one speculative step would launch on the GPU, counted on the CPU: every aten
operator of the draft, verify and accept phases under a dispatch mode, with the GPU's kernels
switched on under Triton's interpreter (cache attention, the few-row matmuls, the top-k), each
Triton kernel, each `@fusable` function and each module models/llama.py's compile_elementwise compiles (RMSNorm, RoPE,
MLP) counted once, and operators that only make views left out. An estimate of the graphs' kernel
counts (step_profile.py gives the real ones on the H200), grouped by the line that launched them:
which code to fuse next. `--sampled` counts a step of a row sampling under top-p (the noise, the draw
under the cut; cut_draw counted once, though over slices it is six launches). A probe, CPU (SmolLM2
in float16; a few minutes under the interpreter).

  TRITON_INTERPRET=1 .venv/bin/python bench/cpu/step_ops.py [--tree 5,4,16] [--sampled] [--out bench/results]
"""
import argparse
import collections
import functools
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from eaglet import cut_draw
from eaglet.config import SpecConfig
from eaglet.default_model import default_model_path
from eaglet.generate import GenerationConfig, Generator
from eaglet.kernels import Kernels
from eaglet.models import attention, cache_attention, llama
from eaglet.perf.record import write_record
from eaglet.sampling import SamplingParams
from eaglet.spec import loop as loop_mod
from eaglet.spec import topk as topk_mod
from eaglet.spec import tree as tree_mod
from eaglet.spec import verify as verify_mod
from eaglet.spec.drafters import eagle3_head
from eaglet.spec.drafters import expand as expand_mod
from eaglet.spec.speculator import bundled_drafter, load_speculator
from eaglet.weights import load_model

VIEWS = {"view", "_unsafe_view", "expand", "slice", "select", "unsqueeze", "squeeze", "t", "transpose", "alias",
         "detach", "permute", "reshape", "split", "split_with_sizes", "unbind", "as_strided", "lift_fresh",
         "empty", "empty_strided", "empty_like", "new_empty", "is_same_size", "_local_scalar_dense", "sym_size",
         "sym_stride", "stride", "flatten", "_reshape_alias"}


class Counter(TorchDispatchMode):
    """Operators outside any counted region, each with the eaglet line that called it."""

    def __init__(self):
        super().__init__()
        self.depth, self.ops = 0, []

    def region(self, name: str, fn):
        @functools.wraps(fn)
        def run(*a, **k):
            if self.depth == 0:
                self.ops.append((name, caller()))
            self.depth += 1
            try:
                return fn(*a, **k)
            finally:
                self.depth -= 1
        return run

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.depth == 0 and func.overloadpacket.__name__ not in VIEWS:
            self.ops.append((str(func.overloadpacket.__name__), caller()))
        return func(*args, **(kwargs or {}))


def caller() -> str:
    frames = [f for f in traceback.extract_stack() if "/eaglet/" in f.filename]
    f = frames[-1] if frames else None
    return f"{f.filename.split('/eaglet/')[-1]}:{f.name}:{f.lineno}" if f else "?"


def instrument(counter: Counter) -> None:
    """Count each Triton kernel, fusable function and compiled module once, where it is called."""
    fuse = Kernels.fuse
    Kernels.fuse = lambda self, fn: counter.region(fn.__name__, fuse(self, fn))  # every @fusable call
    cut_draw.cut_draw = counter.region("cut_draw", cut_draw.cut_draw)
    for mod, names in ((attention, ["slots_and_rows", "attention_mask", "additive_bias"]),
                       (tree_mod, ["ancestor_mask", "kept_tree", "topk"]), (verify_mod, ["greedy_accept"]),
                       (llama, ["rope_cos_sin"]), (eagle3_head, ["rope_cos_sin"]), (cache_attention, ["cache_attention"]),
                       (expand_mod, ["topk", "level_mask", "next_frontier", "candidates"]), (loop_mod, ["settle"])):
        for n in names:
            if hasattr(mod, n):  # the functions of the code being counted (older commits lack some)
                setattr(mod, n, counter.region(n, getattr(mod, n)))
    region = expand_mod.topk  # a row of SPLIT_WIDTH or more is two kernels (pieces, merge)
    split = getattr(topk_mod, "SPLIT_WIDTH", None)

    def topk(x, k, *a, **kw):
        if split is not None and x.shape[-1] >= split and topk_mod.usable(x, k) and counter.depth == 0:
            counter.ops.append(("topk pieces", caller()))
        return region(x, k, *a, **kw)
    expand_mod.topk = topk
    for cls in (llama.RMSNorm, llama.RoPE, llama.MLP):
        cls.forward = counter.region(cls.__name__, cls.forward)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", default="5,4,16", help="STEPS,TOPK,TOKENS; 5,1,6 for the chain of 5")
    ap.add_argument("--sampled", action="store_true", help="the row samples: temperature 0.7, top-p 0.9")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    steps, k, n = map(int, args.tree.split(","))
    path = str(default_model_path())
    kernels = Kernels(gemv=True, cache_attention=True, topk=True, draw=True, compile=False)  # the GPU's, interpreted
    loaded = load_model(path, "float16", "cpu", kernels=kernels)  # the cache-attention kernel takes half precision
    counter = Counter()
    instrument(counter)
    spec = SpecConfig("eagle3", str(bundled_drafter()), steps=steps, topk=k, draft_tokens=n)
    gen = Generator(loaded.model, loaded.tokenizer, load_speculator(spec, loaded.model, path))
    ids = loaded.tokenizer.apply_chat([{"role": "user", "content": "Explain why the sky is blue."}])
    sampling = SamplingParams(0.7, top_p=0.9, seed=1) if args.sampled else SamplingParams()
    gen.generate([ids], GenerationConfig(max_new_tokens=8, ignore_eos=True, sampling=sampling))  # decoders made, caches warm
    step = gen.decoder_in_use().current  # the speculative step
    counts = {}
    for phase in ("draft", "verify", "accept"):
        inner = getattr(type(step), phase)

        def counted(self, *a, inner=inner, phase=phase, **kw):
            counter.ops = []
            with counter:
                out = inner(self, *a, **kw)
            counts[phase] = collections.Counter(w for _, w in counter.ops)
            return out
        setattr(type(step), phase, counted)
    gen.generate([ids], GenerationConfig(max_new_tokens=3, ignore_eos=True, sampling=sampling))  # one step, the last one counted
    results = {}
    for phase, c in counts.items():
        results[phase] = {"kernels": sum(c.values()), "by_line": dict(c.most_common())}
        print(f"{phase}: ~{sum(c.values())} kernels")
        for line, m in c.most_common(12):
            print(f"  {m:4d}  {line}")
    print("record:", write_record("step-ops", {"tree": args.tree, "sampled": args.sampled}, results, args.out))


if __name__ == "__main__":
    main()
