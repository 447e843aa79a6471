"""The speculation loop, read like the paper: draft -> verify -> accept -> commit.

SpecDecoder is a SlotDecoder like generate.PlainDecoder (admit, step, release), so the Generator's
streaming and stopping logic and the server's batching are shared. Each step runs three phases,
each one CUDA graph on the GPU (the draft phase stays eager for host-side drafters): `draft`
proposes (a graphed draft's outputs are the verify graph's inputs; a host drafter's are copied into
them), `verify` is one target forward over all its nodes, `accept` picks the accepted path and
commits it to both caches (`settle`: the bookkeeping after acceptance in one compiled region).
With a drafter on the device and no phase timer or trace, the three run as one graph (`_step`). One host sync per step: the emitted tokens. With a
drafter that works on the device the next step can be launched before that sync (lookahead, see
runtime/decoder.py); a host-side drafter (n-gram) needs the emitted tokens to propose, so it cannot.

`to_plain()` turns a decoder with running rows to plain decoding on the same cache (the server's
policy, when a speculating batch grows): the rows keep their sequences, the drafter is left behind
until `reset`.
"""
from __future__ import annotations

import numpy as np
import torch

from ..config import SpecConfig
from ..kvcache import keep_slots
from ..models.attention import AttnMeta
from ..models.llama import CausalLM
from ..models.prefill import prefill
from ..runtime.compile import fusable
from ..runtime.decoder import SlotDecoder
from ..sampling import SamplingParams, sample, target_probs
from .drafters.base import Drafter
from .metrics import RowCounters, SpecMetrics
from .tree import DraftProposal
from .verify import VerifyResult, cut, greedy_verify, sample_verify


def store(dst: DraftProposal | None, src: DraftProposal) -> DraftProposal:
    """Copy a proposal into persistent buffers (allocated on first use)."""
    if dst is None:
        return DraftProposal(*(None if t is None else t.clone() for t in vars(src).values()))
    for a, b in zip(vars(dst).values(), vars(src).values()):
        if a is not None:
            a.copy_(b)
    return dst


@fusable
def settle(path, count, tokens, limit, lens, roots, valid, depth):
    """What follows acceptance, one compiled region on the GPU (a dozen small kernels otherwise):
    each row cut to its limit (never past its budget; 0 freezes it) and the tokens taken off it,
    the cache moves that keep the accepted path and its new length, the next roots, and the packed
    output for the host, (B, 3 + 2(D+1)): count, drafted nodes, deepest drafted position, tokens,
    path. Updates limit, lens and roots in place; returns count, bonus, moves, packed."""
    count, bonus = cut(count, tokens, limit)
    moves = keep_slots(lens, path, count)  # from the length before this step's
    limit.sub_(count)
    lens.add_(count)
    roots.copy_(bonus)
    drafted = valid.sum(1, keepdim=True) - 1  # (B, 1)
    reach = (depth * valid).amax(1, keepdim=True)  # (B, 1)
    return count, bonus, moves, torch.cat([count[:, None], drafted, reach, tokens, path], 1)


class SpecDecoder(SlotDecoder):
    row_tensors = ("limit", "roots")
    def __init__(self, model: CausalLM, drafter: Drafter, spec: SpecConfig, batch: int, max_len: int,
                 sampling: SamplingParams, generator: torch.Generator | None = None, trace: list | None = None,
                 graphs: bool = True, timer=None, lookahead: bool | None = None):
        super().__init__(model, batch, max_len + spec.draft_tokens, sampling, generator, graphs, timer, lookahead)
        self.drafter, self.spec = drafter, spec
        # the profiler's trace reads the proposal of the step just collected
        self.lookahead = self.lookahead and drafter.graphable and trace is None
        self.counters = RowCounters(batch, spec.steps)  # each row's draft counters since its admission
        self.drafted = SpecMetrics()  # the draft counters of the steps collected since take_drafted()
        self.roots = torch.zeros(batch, dtype=torch.long, device=self.device)  # each row's last emitted token
        self.prop: DraftProposal | None = None  # the verify graph's input
        self.trace = trace  # the profiler's: per step (scores, depths, accepted path, count, limit)
        # cache slots one step may touch past the committed length, target and drafter
        self.room = spec.draft_tokens
        self.drafter_room = spec.steps + 1 + spec.steps * spec.topk + 1
        self.plain = False  # decoding plain since to_plain(), until reset()

    @property
    def metrics(self) -> list[SpecMetrics]:
        """Each row's draft counters since its admission."""
        return [self.counters.of(r) for r in range(self.batch)]

    def take_drafted(self) -> SpecMetrics:
        """The draft counters of the steps collected since the last call, over all rows."""
        d, self.drafted = self.drafted, SpecMetrics()
        return d

    @property
    def tokens_per_step(self) -> int:
        return 1 if self.plain else self.spec.steps + 1

    def to_plain(self) -> list[list[list[int]]]:
        """Decode plain from the next step on. Collects the steps in flight first (they are
        speculative) and returns their tokens per row, oldest step first."""
        done = [self.collect() for _ in range(len(self.in_flight))]
        self._set_plain(True)
        return done

    def reset(self) -> None:
        super().reset()
        self._set_plain(False)

    def _set_plain(self, on: bool) -> None:
        # the row views too: they are kept, since their captured graphs read their own buffers
        for d in (self, *self._views.values()):
            d.plain = on

    def warmup(self, rows: int | None = None, prompt_tokens: int = 1024, plain_rows: int = 0) -> int:
        """SlotDecoder.warmup's speculative steps for up to `rows` rows, then, when `plain_rows`
        is given, its plain ones for up to that many (a server batch that grows turns plain)."""
        n = super().warmup(rows, prompt_tokens)
        if plain_rows and self.graphs.enabled:
            self.to_plain()
            n += super().warmup(plain_rows, prompt_tokens)
            self.reset()
        return n

    def rows_in_use(self) -> int:
        # the profiler's trace records whole-batch proposals (and reads them in _collect)
        return self.batch if self.trace is not None else super().rows_in_use()

    def _make_view(self, k: int) -> "SpecDecoder":
        v = super()._make_view(k)
        v.drafter, v.prop = self.drafter.rows(k), None  # the view's proposal buffers are its own
        return v

    def _prefill_key(self, shape):
        return ("prefill", self.plain) + shape

    def _prefill(self, batch):
        h, taps = prefill(self.model, self.cache, batch, capture=() if self.plain else self.drafter.taps)  # (b, H)
        first = sample(self.model.logits(h), self.sampling, self.gen)  # (b,)
        self.roots.index_copy_(0, batch.rows, first)
        if not self.plain:  # after to_plain the drafter is left behind
            self.drafter.start(batch, taps, first)
        return first

    def _admitted(self, rows, prompts, first):
        if not self.plain:
            self.drafter.start_host(rows, prompts, first)
        self.counters.reset(rows)

    def release(self, rows: list[int]) -> None:
        super().release(rows)
        self.drafter.release(rows)

    # ---- the three phases; each reads and writes only persistent tensors ----
    def _draft(self) -> DraftProposal:
        return self.drafter.propose(self.roots)

    def _step(self) -> torch.Tensor:
        """The three phases as one body: one CUDA graph a step on the GPU where the drafter works on
        the device and nothing times or traces the phases apart (they then run as three graphs)."""
        self.prop = self._draft()
        return self._accept(*self._verify())

    def _verify(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every node in one target forward: tree mask, per-node positions. Returns the target's
        argmax (B, N) under greedy or its distribution (B, N, V), and the drafter's taps."""
        prop, c = self.prop, self.cache
        positions = c.lens[:, None] + prop.depth  # (B, N)
        meta = AttnMeta.build(c.lens, positions, c.kv_len(prop.num_nodes), tree_mask=prop.mask,
                              sliding_window=self.model.config.sliding_window)
        hidden, taps = self.model(prop.tokens, positions, c, meta, capture=self.drafter.taps)
        logits = self.model.logits(hidden)  # (B, N, V); no float copy for an argmax
        return (logits.argmax(-1) if self.sampling.greedy else target_probs(logits, self.sampling)), taps

    def _accept(self, target: torch.Tensor, taps: torch.Tensor | None) -> torch.Tensor:
        """Accept, cut to each row's limit, commit to both caches; pack what the host needs."""
        prop = self.prop
        if self.sampling.greedy:
            res = greedy_verify(prop, target, self.spec.steps)
        else:
            res = sample_verify(prop, target, self.spec.steps, self.spec.topk, self.gen)
        count, bonus, moves, packed = settle(res.path, res.count, res.tokens, self.limit, self.cache.lens,
                                             self.roots, prop.valid, prop.depth)
        self.cache.move(*moves)  # only the accepted path stays
        self.drafter.commit(prop, VerifyResult(res.path, count, res.tokens, bonus), taps)
        return packed

    def _launch(self) -> torch.Tensor:
        """One draft-verify-accept-commit round, enqueued (a plain step after to_plain)."""
        if self.plain:
            return self._launch_plain(self.roots)
        if self.trace is not None:
            self._trace_limit = self.limit.tolist()  # sync: profiling only (no lookahead with a trace)
        dc = getattr(self.drafter, "cache", None)
        drafter = [(dc, self.drafter_room)] if dc is not None else []
        key = (self.batch, *self.span_of(self.cache, self.room, *drafter))
        if self.drafter.graphable and self.timer is None and self.trace is None:
            return self.graphs.run(("step",) + key, self._step)  # one launch a step, not three
        with self.phase("draft"):
            prop = self.graphs.run(("draft",) + key, self._draft, graph=self.drafter.graphable)
            # a graphed draft's output is its graph's own buffers, refreshed by each replay, which the
            # verify graph of the same key reads; a host drafter's is new each step, so a graphed verify
            # needs it copied into the buffers it was captured with
            self.prop = store(self.prop, prop) if self.graphs.enabled and not self.drafter.graphable else prop
        with self.phase("verify"):
            target, taps = self.graphs.run(("verify",) + key, self._verify)
        with self.phase("accept"):
            return self.graphs.run(("accept",) + key, lambda: self._accept(target, taps))

    def _collect(self, rows, same):
        if self.plain:
            return self._collect_plain(rows, same)
        d1 = self.spec.steps + 1
        counts = [r[0] if ok else 0 for r, ok in zip(rows, same)]
        emitted = [r[3:3 + n] for r, n in zip(rows, counts)]
        self.cache.commit_host(counts)
        self.drafter.commit_host(emitted)
        drew = [i for i, n in enumerate(counts) if n > 0 and self.live[i]]  # not a step past a stop the host has seen
        if drew:
            head = np.array([rows[i][:3] for i in drew])  # count, drafted nodes, deepest drafted position
            self.drafted.merge(self.counters.record(drew, head[:, 0] - 1, head[:, 1], head[:, 2]))
        if self.trace is not None and self.prop.score is not None:
            paths = torch.tensor([r[3 + d1:3 + 2 * d1] for r in rows])
            score, depth = (t.to("cpu", copy=True) for t in (self.prop.score, self.prop.depth))  # sync: profiling only
            self.trace.append((score, depth, paths, counts, self._trace_limit))
        return emitted
