"""`eaglet profile`: everything the cost model needs, measured on this machine for this target and
drafter: the plain decode step, one draft level (per top-k width), the verify-cost curve over token
counts (per batch size), the per-step overhead, and acceptance: per draft position for chains, and
for trees the accepted path against the ranked draft nodes, from which the accept length of any
smaller tree (fewer levels, fewer verified nodes, same top-k) follows exactly."""
from __future__ import annotations

import dataclasses
import time

import torch

from ..config import SpecConfig
from ..generate import GenerationConfig, Generator
from ..kvcache import KVCache
from ..models.attention import AttnMeta
from ..sampling import RowSampling
from ..spec.drafters.base import start_rows
from ..spec.metrics import SpecMetrics
from ..runtime.graphs import GraphRunner, span
from ..runtime.observer import StepObserver
from ..spec.speculator import Speculator
from .curves import forward_curve, time_ms

VERIFY_TOKENS = (1, 2, 4, 8, 16, 32, 64)
BUDGETS = (4, 8, 12, 16, 24, 32, 48, 64)


@torch.inference_mode()
def measure_costs(model, speculator: Speculator, batch: int, context: int, topks: tuple[int, ...],
                  chain_steps: int = 0) -> dict:
    """decode_ms, verify_ms{tokens}, draft_ms{topk} at `context` committed tokens, `batch` rows,
    each as the runtime runs it: a captured CUDA graph on the GPU, eager on the CPU. The verify
    curve has every chain's token count (1 .. chain_steps + 1) measured, not interpolated: on the
    CPU it is not smooth (a 6-token verify cost 71 ms where 4 and 8 tokens cost 47 and 62)."""
    p = next(model.parameters())
    dev = p.device
    graphs = dev.type == "cuda"
    tokens = tuple(sorted(set(VERIFY_TOKENS) | set(range(1, chain_steps + 2))))
    curve = forward_curve(model, tokens, context, graphs, batch=batch, repeats=7)
    # keys are strings, as they come back from the JSON record
    out = {"batch": batch, "context": context, "decode_ms": curve["1"], "verify_ms": curve, "draft_ms": {},
           "cuda_graphs": graphs}
    cfg = model.config
    cache = KVCache.for_model(cfg, batch, context + 8, p.dtype, dev)
    ids = torch.randint(100, cfg.vocab_size - 1, (batch, context), generator=torch.Generator().manual_seed(0)).to(dev)
    pos = torch.arange(context, device=dev).expand(batch, context)
    taps_layers = getattr(speculator.head, "cfg", None)
    capture = taps_layers.aux_layers if taps_layers else ()
    _, taps = model(ids, pos, cache, AttnMeta.build(cache.lens, pos, context, kernels=model.kernels), capture=capture)
    del cache
    # one draft level, all overheads included: a whole `propose` of `levels` levels, divided by them
    # (the catch-up forward counts as the first level, as it does in the cost model)
    levels = 4
    for k in topks:
        spec = SpecConfig(speculator.spec.method, speculator.spec.draft, steps=levels, topk=k,
                          draft_tokens=None if k == 1 else levels + 1)
        drafter = dataclasses.replace(speculator, spec=spec).make(model, batch, context + 8 + levels * k)
        start_rows(drafter, list(range(batch)), [ids[b].tolist() for b in range(batch)], taps, ids[:, -1])
        saved = drafter.save_state() if hasattr(drafter, "save_state") else None  # n-gram: host history only
        if saved is not None:
            drafter.cache.kv_limit = span(context + 2 * levels * (k + 1), drafter.cache.max_len)
        runner = GraphRunner(dev, graphs and drafter.graphable)
        roots = ids[:, -1]
        greedy = RowSampling(batch, dev)  # every row greedy: the drafter's argmax path

        def propose(d=drafter, saved=saved, runner=runner, roots=roots):
            if saved is not None:  # back to the same state: nothing proposed is ever committed
                d.load_state(saved)
            runner.run("propose", lambda: d.propose(roots, greedy))
        propose()  # warm-up (and the eager first call of the graph)
        out["draft_ms"][str(k)] = time_ms(propose, dev, repeats=7) / levels
    return out


class DraftTrace(StepObserver):
    """The proposals of a tree's collected steps, for tree_tau_table: per step (scores (B, N),
    depths (B, N), accepted paths (B, D+1), emitted counts, token limits before the step), on the
    host. Its steps cover the whole batch, one at a time (needs_proposal), and run phase by phase,
    as the measured step times (measure_acceptance) count them."""
    apart = True
    needs_proposal = True

    def __init__(self):
        self.steps: list[tuple] = []

    def on_collect(self, step) -> None:
        if step.prop is None or step.prop.score is None:  # a chain's proposal has no scores
            return
        score, depth = (t.to("cpu", copy=True) for t in (step.prop.score, step.prop.depth))  # sync: profiling only
        self.steps.append((score, depth, torch.tensor(step.paths()), step.counts, step.limits()))


def tree_tau_table(trace: list, steps_grid: range, budgets: tuple[int, ...]) -> dict[str, float]:
    """Accept length of every smaller tree (s levels, n verified nodes) from a measured tree's trace.

    The smaller tree of the same top-k keeps the best n-1 candidates of depth <= s, which (as long
    as the measured tree kept at least that many such nodes) are its own best n-1 nodes of depth
    <= s; its accepted path is the measured path cut at the first node it lacks."""
    sums = {(s, n): 0 for s in steps_grid for n in budgets}
    rows = 0
    for score, depth, path, counts, limits in trace:
        max_count = depth.shape[1]
        for b in range(score.shape[0]):
            if limits[b] < max_count:  # the budget cut this step short: it would bias τ down
                continue
            rows += 1
            sc, dp = score[b, 1:].tolist(), depth[b, 1:].tolist()
            acc_nodes = [int(i) - 1 for i in path[b, 1:counts[b]].tolist()]
            for s in steps_grid:
                eligible = sorted((i for i in range(len(sc)) if dp[i] <= s), key=lambda i: (-sc[i], i))
                for n in budgets:
                    top = set(eligible[: n - 1])
                    k = 0
                    while k < len(acc_nodes) and acc_nodes[k] in top and dp[acc_nodes[k]] <= s:
                        k += 1
                    sums[(s, n)] += 1 + k
    return {f"{s},{n}": v / rows for (s, n), v in sums.items()} if rows else {}


def measure_acceptance(model, tok, base: Speculator, prompts: list[list[int]], max_new: int, batch: int,
                       chain_steps: int, trees: list[tuple[int, int, int]]) -> dict:
    """Chain: per-position acceptance of a `chain_steps` chain. Trees: τ table per top-k. Also the
    measured wall time per speculation step (for the overhead estimate), from a second pass over the
    prompts: the first meets each attention span's graphs cold (an eager call, then a capture, tens
    of ms each), which once made ShareGPT's varied lengths read as a 4.4 ms chain step instead of ~1.2."""
    out = {"chain": {}, "trees": {}}
    gen_cfg = GenerationConfig(max_new_tokens=max_new)

    def passes(g: Generator, trace: DraftTrace | None = None):
        """Two passes over the prompts in batches, the second timed; the first warms every graph
        the second meets (the same prompts, so the same lengths and attention spans)."""
        for _ in range(2):
            if trace is not None:
                trace.steps.clear()  # the timed pass's steps only
            t0, results = time.perf_counter(), []
            for i in range(0, len(prompts), batch):
                results.append(g.generate(prompts[i:i + batch], gen_cfg))
        return [c for batch_out in results for c in batch_out], time.perf_counter() - t0

    def run(spec: SpecConfig, trace=None):
        results, secs = passes(Generator(model, tok, dataclasses.replace(base, spec=spec), observer=trace), trace)
        total = SpecMetrics()
        for c in results:
            total.merge(c.spec)
        return total, secs

    results, secs = passes(Generator(model, tok))
    n_tok = sum(max(len(c.tokens) for c in results[i:i + batch]) for i in range(0, len(results), batch))  # steps
    out["plain"] = {"step_ms_measured": secs * 1e3 / n_tok}
    method, draft = base.spec.method, base.spec.draft
    m, secs = run(SpecConfig(method, draft, steps=chain_steps))
    out["chain"] = {"steps": chain_steps, "accept_per_pos": m.acceptance_rate_per_pos, "accept_length": m.accept_length,
                    "drafts": m.drafts, "step_ms_measured": secs * 1e3 / max(1, m.drafts) * min(batch, len(prompts))}
    for steps, topk, n in trees:
        trace = DraftTrace()
        m, secs = run(SpecConfig(method, draft, steps=steps, topk=topk, draft_tokens=n), trace)
        table = tree_tau_table(trace.steps, range(1, steps + 1), tuple(b for b in BUDGETS if b <= n))
        out["trees"][str(topk)] = {"steps": steps, "draft_tokens": n, "accept_length": m.accept_length,
                                   "tau": table, "drafts": m.drafts,
                                   "step_ms_measured": secs * 1e3 / max(1, m.drafts) * min(batch, len(prompts))}
    return out
