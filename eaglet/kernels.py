"""Which kernels a model runs, chosen once when it is loaded and handed down to everything that runs
on it: its layers, the decoders and the drafters. A frozen value, so two models with different
choices can live in one process, and nothing switches a kernel on or off behind a model's back.

- `gemv`: matmuls of 1 to 16 rows (decoding, drafting, verify) as Triton kernels (models/gemv.py),
  faster than cuBLAS at streaming the weights; the MLP's gate-up with its SiLU·mul in the same kernel.
- `cache_attention`: attention of a few new tokens per row over the KV cache as one Triton kernel
  that rotates q and k, stores the new keys and values, attends and lays out the output
  (models/cache_attention.py); for MLA, over the latent cache in the absorbed form
  (models/mla_attention.py).
- `topk`: the top-k of each row a draft tree takes at every level, with its log-softmax, as one
  Triton kernel (spec/topk.py).
- `draw`: a sampled row's draw under its top-k / top-p cut, as one Triton kernel that finds the
  cut's threshold without sorting the vocabulary (cut_draw.py).
- `moe`: the routed experts of 1 to 64 tokens as Triton kernels that read each touched expert's
  weights once (models/fused_moe.py): on the H200 at the touched-bytes floor for Kimi-K2's layer and
  faster than torch._grouped_mm at every token count (BENCHMARKS.md, "MoE layer").
- `exact`: attention that reduces each token of a decode, draft or verify alike whatever else is in
  the call (models/exact.py): a verified token's logits bitwise those of its decode step, a row's
  those it gets alone; on the GPU with a row-invariant matmul and norm and models/exact_attention.py,
  graphed (MLA attention and prefill eager). Slower (`--exact` states the cost).
- `compile`: torch.compile of the elementwise modules of every layer (RMSNorm with its residual
  add, RoPE with the grouped-query relayout, the MLP's gate-up / SiLU·mul / down) and of the
  functions marked `@fusable` (the index arithmetic around the model: attention masks, greedy
  acceptance, tree levels), dozens of tiny kernels per speculation step each.

Decoding at small batch is bound by kernel count, not bytes, so this is where the time goes
(BENCHMARKS.md, "Model runtime"). Shapes are dynamic, so one compile serves every batch size and
token count; the CUDA graphs are captured around the compiled kernels. On the CPU, or with
`--no-compile`, everything runs as written. Under TRITON_INTERPRET=1 (the CPU tests) a `Kernels`
with the Triton kernels on runs them in Triton's interpreter.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

try:
    import triton
except ImportError:  # CPU installs without Triton: torch's kernels run
    triton = None

KERNEL_NAMES = ("gemv", "cache-attention", "topk", "moe", "draw")  # what --disable-kernels accepts


@dataclass(frozen=True)
class Kernels:
    gemv: bool = False
    cache_attention: bool = False
    topk: bool = False
    compile: bool = False
    moe: bool = False  # routed experts of 1 to 64 tokens as Triton kernels (models/fused_moe.py)
    draw: bool = False  # a sampled row's draw under its top-k / top-p cut without a sort (cut_draw.py)
    exact: bool = False  # a token's attention reduced alike whatever shares its call (models/exact.py)

    @staticmethod
    def choose(device: torch.device | str, compile: bool = True, disable: tuple[str, ...] = (),
               exact: bool = False) -> "Kernels":
        """The kernels for a model on `device`: on a CUDA GPU with Triton, every Triton kernel whose
        bfloat16 dot products the GPU has (Ampere or newer; older ones keep SDPA and cuBLAS) and, with
        `compile`, torch.compile; on the CPU, torch's own. `disable` names kernels to leave out
        (KERNEL_NAMES), for side-by-side runs. `exact` on the GPU keeps only the kernels that reduce a
        row alike at any row count (the MoE kernels, the drafter's top-k) beside the exact path's own
        (models/exact.py): no GEMV, no cache-attention kernel, nothing compiled."""
        unknown = set(disable) - set(KERNEL_NAMES)
        if unknown:
            raise ValueError(f"unknown kernel {sorted(unknown)[0]!r} (choose from {', '.join(KERNEL_NAMES)})")
        device = torch.device(device)
        if device.type != "cuda":
            return EXACT if exact else EAGER
        if exact:
            if triton is None:
                raise ValueError("the exact path on the GPU needs Triton")
            return dataclasses.replace(Kernels.choose(device, False, disable + ("gemv", "cache-attention")), exact=True)
        ampere = torch.cuda.get_device_capability(device)[0] >= 8 and triton is not None
        return Kernels(gemv=ampere and "gemv" not in disable,
                       cache_attention=ampere and "cache-attention" not in disable,
                       topk=triton is not None and "topk" not in disable, compile=compile,
                       moe=ampere and "moe" not in disable, draw=triton is not None and "draw" not in disable)

    def fuse(self, fn: Callable) -> Callable:
        """`fn` (a `@fusable` function) compiled when this configuration compiles, as written otherwise."""
        return compiled(fn) if self.compile else fn


EAGER = Kernels()  # torch's kernels, nothing compiled: the CPU, tests, training
EXACT = Kernels(exact=True)  # the CPU's exact path


@functools.cache
def compiled(fn: Callable) -> Callable:
    """One compiled version of each function, shared by every model that compiles."""
    return torch.compile(fn, dynamic=True, fullgraph=True)


def fusable(fn: Callable) -> Callable:
    """Marks a pure function of tensors, lists of tensors and ints whose body torch.compile fuses into
    a few kernels; callers run it through `Kernels.fuse` (tests trace it whole: test_fusable.py)."""
    fn.fusable = True
    return fn
