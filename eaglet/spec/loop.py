"""The speculation step, read like the paper: draft -> verify -> accept -> commit.

`SpecStep` is a step of the decode runtime (runtime/decoder.py) like the plain one, so admission,
rows, graphs, lookahead and the Generator's streaming and stopping are shared. Each step runs three
phases, each one CUDA graph on the GPU (the draft phase stays eager for host-side drafters): `draft`
proposes (a graphed draft's outputs are the verify graph's inputs; a host drafter's are copied into
them), `verify` is one target forward over all its nodes, `accept` picks the accepted path and
commits it to both caches (`settle`: the bookkeeping after acceptance in one compiled region).
With a drafter on the device and no observer that watches the phases apart, the three run as one
graph (`step`). One host sync per step: the emitted tokens. With a drafter that works on the device
the next step can be launched before that sync (lookahead); a host-side drafter (n-gram) needs the
emitted tokens to propose, so it cannot.

A batch turns plain on the same cache by `Decoder.use(decoder.plain)`: the rows keep their
sequences, the drafter is left behind until this step is used again on freed rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..config import SpecConfig
from ..kvcache import keep_slots
from ..models.attention import AttnMeta
from ..models.llama import CausalLM
from ..models.prefill import prefill
from ..kernels import fusable
from ..runtime.decoder import Decoder, Slots
from ..runtime.graphs import GraphRunner
from ..runtime.observer import StepObserver
from ..runtime.plain import eos_reach, first_tokens
from .drafters.base import Drafter
from .metrics import RowCounters, SpecMetrics
from .tree import DraftProposal
from .verify import VerifyResult, cut, greedy_verify


def store(dst: DraftProposal | None, src: DraftProposal) -> DraftProposal:
    """Copy a proposal into persistent buffers (allocated on first use)."""
    if dst is None:
        return DraftProposal(*(None if t is None else t.clone() for t in vars(src).values()))
    for a, b in zip(vars(dst).values(), vars(src).values()):
        if a is not None:
            a.copy_(b)
    return dst


@fusable
def settle(path, count, tokens, limit, lens, roots, valid, depth, eos, stops):
    """What follows acceptance, one compiled region on the GPU (a dozen small kernels otherwise):
    each row cut to its limit (never past its budget; 0 freezes it) and to its first EOS if it
    stops there (then its limit drops to 0: eos_reach) and the tokens taken off it, the cache
    moves that keep the accepted path and its new length, the next roots, and the packed output for
    the host, (B, 3 + 2(D+1)): count, drafted nodes, deepest drafted position, tokens, path.
    Updates limit, lens and roots in place; returns count, bonus, moves, packed."""
    to_eos = eos_reach(tokens, eos, stops)
    count, bonus = cut(count, tokens, torch.minimum(limit, to_eos))
    moves = keep_slots(lens, path, count)  # from the length before this step's
    limit.sub_(count)
    limit.masked_fill_(count == to_eos, 0)
    lens.add_(count)
    roots.copy_(bonus)
    drafted = valid.sum(1, keepdim=True) - 1  # (B, 1)
    reach = (depth * valid).amax(1, keepdim=True)  # (B, 1)
    return count, bonus, moves, torch.cat([count[:, None], drafted, reach, tokens, path], 1)


@dataclass
class Collected:
    """A speculation step as the host collected it, for an observer (StepObserver.on_collect)."""
    prop: DraftProposal | None  # what the step over every row proposed (device; None if none ran)
    packed: list[list[int]]  # settle's output per row
    counts: list[int]  # tokens each row emitted
    limit: torch.Tensor  # (B,) each row's token limit after the step (device)

    def paths(self) -> list[list[int]]:
        """Each row's accepted path: node indices, root first (D+1, padded)."""
        d1 = (len(self.packed[0]) - 3) // 2
        return [r[3 + d1:] for r in self.packed]

    def limits(self) -> list[int]:
        """Each row's token limit before the step (a row the step stopped at EOS reads as cut to
        what it emitted, its limit being 0 after)."""
        return [n + r[0] for n, r in zip(self.limit.tolist(), self.packed)]  # sync: observers only


class SpecStep:
    def __init__(self, model: CausalLM, slots: Slots, drafter: Drafter, spec: SpecConfig, name: str = "spec",
                 counters: RowCounters | None = None):
        self.model, self.slots, self.drafter, self.spec, self.name = model, slots, drafter, spec, name
        self.kernels, self.settle = model.kernels, model.kernels.fuse(settle)
        self.tokens_per_step = spec.steps + 1
        self.pipelines = drafter.graphable  # a host drafter proposes from the emitted tokens
        # each row's draft counters since its admission (shared by the settings of one drafter: Engine.step)
        self.counters = counters if counters is not None else RowCounters(slots.batch, spec.steps)
        self.prop: DraftProposal | None = None  # the verify graph's input

    @property
    def metrics(self) -> list[SpecMetrics]:
        """Each row's draft counters since its admission (until its release)."""
        return self.counters.every()

    def take_drafted(self) -> SpecMetrics:
        """The draft counters of the steps collected since the last call, over all rows."""
        return self.counters.take()

    def rows(self, k: int) -> "SpecStep":
        return SpecStep(self.model, self.slots.rows(k), self.drafter.rows(k), self.spec, self.name)

    def room(self):
        # cache slots one step may touch past the committed length, target and drafter
        s, dc = self.spec, getattr(self.drafter, "cache", None)
        drafter = [(dc, s.steps + 1 + s.steps * s.topk + 1)] if dc is not None else []
        return [(self.slots.cache, s.draft_tokens)] + drafter

    def prefill(self, batch):
        h, taps = prefill(self.model, self.slots.cache, batch, capture=self.drafter.taps)  # (b, H)
        first = first_tokens(self.model.logits(h), self.slots, batch, self.model.kernels)
        self.drafter.start(batch, taps, first)
        return first

    def admitted(self, rows, prompts, first):
        self.drafter.start_host(rows, prompts, first)
        self.counters.reset(rows)

    def release(self, rows: list[int]) -> None:
        self.drafter.release(rows)
        self.counters.reset(rows)

    # ---- the step; each phase reads and writes only persistent tensors ----
    def launch(self, graphs: GraphRunner, key: tuple, observer: StepObserver) -> torch.Tensor:
        """One draft-verify-accept-commit round, enqueued."""
        if self.drafter.graphable and not observer.apart:
            return graphs.run(("step", *key), self.step)  # one launch a step, not three
        with observer.phase("draft"):
            prop = graphs.run(("draft", *key), self.draft, graph=self.drafter.graphable)
            # a graphed draft's output is its graph's own buffers, refreshed by each replay, which the
            # verify graph of the same key reads; a host drafter's is new each step, so a graphed verify
            # needs it copied into the buffers it was captured with
            self.prop = store(self.prop, prop) if graphs.enabled and not self.drafter.graphable else prop
        with observer.phase("verify"):
            target, taps = graphs.run(("verify", *key), self.verify)
        with observer.phase("accept"):
            return graphs.run(("accept", *key), lambda: self.accept(target, taps))

    def step(self) -> torch.Tensor:
        """The three phases as one body (one CUDA graph a step)."""
        self.prop = self.draft()
        return self.accept(*self.verify())

    def draft(self) -> DraftProposal:
        return self.drafter.propose(self.slots.last, self.slots.sampling)

    def verify(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every node in one target forward: tree mask, per-node positions. Returns the target's
        token after every node (B, N): its argmax, or a sampled row's draw at that position
        (RowSampling.pick), and the drafter's taps."""
        prop, c = self.prop, self.slots.cache
        positions = c.lens[:, None] + prop.depth  # (B, N)
        meta = AttnMeta.build(c.lens, positions, c.kv_len(prop.num_nodes), tree_mask=prop.mask, kernels=self.kernels,
                              sliding_window=self.model.config.sliding_window)
        hidden, taps = self.model(prop.tokens, positions, c, meta, capture=self.drafter.taps)
        logits = self.model.logits(hidden)  # (B, N, V); no float copy for an argmax
        return self.slots.sampling.pick(logits, prop.depth + 1, self.kernels), taps

    def accept(self, target: torch.Tensor, taps: torch.Tensor | None) -> torch.Tensor:
        """Accept (the longest path of drafts equal to the target's tokens: lossless for sampled
        rows too, whose target tokens are their draws), cut to each row's limit, commit to both
        caches; pack what the host needs."""
        prop, s = self.prop, self.slots
        res = greedy_verify(prop, target, self.spec.steps, self.kernels)
        count, bonus, moves, packed = self.settle(res.path, res.count, res.tokens, s.limit, s.cache.lens, s.last,
                                                  prop.valid, prop.depth, s.eos, s.stops)
        s.cache.keep(*moves)  # only the accepted path stays
        self.drafter.commit(prop, VerifyResult(res.path, count, res.tokens, bonus), taps)
        return packed

    def collect(self, rows, same, live, observer) -> list[list[int]]:
        counts = [r[0] if ok else 0 for r, ok in zip(rows, same)]
        emitted = [r[3:3 + n] for r, n in zip(rows, counts)]
        self.slots.cache.commit_host(counts)
        self.drafter.commit_host(emitted)
        drew = [i for i, n in enumerate(counts) if n > 0 and live[i]]  # not a step past a stop the host has seen
        if drew:
            head = np.array([rows[i][:3] for i in drew])  # count, drafted nodes, deepest drafted position
            self.counters.record(drew, head[:, 0] - 1, head[:, 1], head[:, 2])
        observer.on_collect(Collected(self.prop, rows, counts, self.slots.limit))
        return emitted


def spec_decoder(model: CausalLM, drafter: Drafter, spec: SpecConfig, batch: int, max_len: int, graphs: bool = True,
                 lookahead: bool | None = None, observer: StepObserver | None = None,
                 eos: frozenset[int] = frozenset()) -> Decoder:
    """A decoder of `batch` rows, room for `max_len` tokens each (and a step's drafted nodes),
    speculating with `drafter`; rows admitted to stop at EOS stop at `eos` on the device."""
    dec = Decoder(model, batch, max_len + spec.draft_tokens, graphs, lookahead, observer, eos)
    dec.use(SpecStep(model, dec.slots, drafter, spec))
    return dec
