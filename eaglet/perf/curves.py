"""The cost of one target forward of T new tokens at a fixed context: T = 1 is the plain decode
step, T > 1 a verify of T draft nodes (causal; a tree costs the same). Timed with CUDA events per
call, eager or as a captured graph, median over repeats after warm-up."""
from __future__ import annotations

import statistics
import time

import torch

from ..kvcache import KVCache
from ..models.attention import AttnMeta
from ..models.llama import CausalLM
from ..models.moe import SparseMoE
from ..runtime.graphs import GraphRunner, graphable, span
from ..sampling import argmax


def time_ms(fn, device, repeats: int) -> float:
    """Median milliseconds of fn() over repeats (CUDA events on the GPU, the wall clock on the CPU)."""
    out = []
    for _ in range(repeats):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


@torch.inference_mode()
def forward_steps(model: CausalLM, tokens: tuple[int, ...], context: int, graphs: bool, batch: int = 1):
    """Yields (T, step) for each T: `step()` runs one forward of T tokens (logits of every row
    included) on `batch` rows holding `context` committed tokens, warmed up (and captured when
    `graphs`). Nothing is committed, so every call sees the same state."""
    p = next(model.parameters())
    dev, cfg = p.device, model.config
    cache = KVCache.for_model(cfg, batch, context + max(tokens) + 128, p.dtype, dev)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, context + max(tokens)), generator=gen).to(dev)
    for lo in range(0, context, 1024):  # fill the context in chunks
        hi = min(context, lo + 1024)
        pos = cache.lens[:, None] + torch.arange(hi - lo, device=dev)
        model(ids[:, lo:hi], pos, cache, AttnMeta.build(cache.lens, pos, cache.kv_len(hi - lo), kernels=model.kernels))
        cache.advance(hi - lo)
    runner = GraphRunner(dev, graphs and graphable(model))
    for t in tokens:
        x = ids[:, context:context + t]
        pos = cache.lens[:, None] + torch.arange(t, device=dev)  # (B, T)
        cache.kv_limit = span(context + t, cache.max_len)

        def body(x=x, pos=pos, t=t):
            h, _ = model(x, pos, cache, AttnMeta.build(cache.lens, pos, cache.kv_len(t), kernels=model.kernels))
            return argmax(model.logits(h), model.kernels)  # (B, T): what greedy verify reads (its pick)

        step = lambda body=body, t=t: runner.run(("fwd", t), body)  # noqa: E731
        for _ in range(3):  # eager warm-up, capture, first replay
            step()
        yield t, step
    cache.kv_limit = None


@torch.inference_mode()
def forward_curve(model: CausalLM, tokens: tuple[int, ...], context: int, graphs: bool, batch: int = 1,
                  repeats: int = 20, experts: dict | None = None) -> dict[str, float]:
    """{str(T): ms} for one forward of T tokens at `context` (forward_steps), median of `repeats`.
    For an MoE model, `experts` receives {str(T): distinct experts a sparse layer touched, on
    average over its forwards} from the layers' counters."""
    dev = next(model.parameters()).device
    moe = [m for m in model.modules() if isinstance(m, SparseMoE)]
    out = {}
    for t, step in forward_steps(model, tokens, context, graphs, batch):
        for m in moe:
            m.reset_counts()
        out[str(t)] = time_ms(step, dev, repeats)
        if moe and experts is not None:  # sync: after the timing
            experts[str(t)] = sum(m.touched.item() / max(m.forwards.item(), 1) for m in moe) / len(moe)
    return out
