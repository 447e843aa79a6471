"""The decode runtime: one `Decoder` owns a batch of rows (slots) of the target's KV cache, the
graph runner, per-row token limits, the steps in flight, row buckets and warm-up, and admits
prompts into free rows while other rows keep going (the server's continuous batching; Generator
admits a whole batch at once). What one step *does* is an object it is handed (`Step`): the plain
step (runtime/plain.py, one token a row) or the speculative one (spec/loop.py). `use(step)` swaps
it between steps on the same rows and cache: the server turns a speculating batch plain that way.
Every step a decoder has run keeps its captured graphs (their keys carry the step's name).

The per-row state every step shares is `Slots`: the cache, each row's token limit on the device
(the tokens it may still emit) and its last emitted token (the next step's input). A step emits at
most a row's limit and subtracts what it emitted, so the host sets a limit only when it changes
(`set_rows`: a new request's budget, 0 once the host sees it stop); 0 freezes the row, its cache
does not move. A row that stops on EOS (`admit(stops=...)`) gets limit 0 from the step that emits
one (plain.eos_reach): the device stops it within a trip, before the host has seen the token.

`launch()` enqueues one step and starts its packed output on its way to the host; `collect()` waits
for the oldest step in flight and returns each row's emitted tokens. Nothing else in a step needs the
host, so on the GPU a caller may launch step t+1 before it collects step t (`lookahead`, where the
step allows it): the host's work on step t (streaming, stopping, bookkeeping) then overlaps the
GPU's work on t+1 instead of leaving the GPU idle. `advance` launches the steps of a trip
(`trip` steps, default 1) back to back and hands the host their tokens together: one wait, one pass
over the rows, one chunk a request for several steps, so a loaded server's per-step host work
(bookkeeping, detokenizing, streaming) is paid once a trip. A row that meets a stop string runs
on to the end of its trip (and the one in flight); those tokens are dropped. A row released or
re-admitted while a step was in flight gets nothing from that step (`epoch`). `step(limit)` is the synchronous form: set every
row's limit, launch, collect.

A step runs only over rows 0..k-1, k the smallest bucket (1, 2, 4, ..., batch) that holds every
row with tokens left (`rows_in_use`): a server with room for 64 requests and one running steps one
row, not 64. `prefix(k)` is the step in use over those rows (`Step.rows(k)`: the same storage,
sliced, with buffers of its own for its graphs), made once per step and k.

Admitting prompts is one graphed prefill of any set of free rows (models/prefill.py), keyed by the
row bucket of the number of prompts (the last prompt fills the rest, written twice into its own
row) and their padded length. `warmup()` runs the common keys twice before a server takes
requests, so none meets a graph's eager first call (a capture waits for the device and stalls
the steps in flight).

An observer (runtime/observer.py: the phase timer, the profiler's trace) is handed in; the decoder
and the steps call it, nothing else in a step knows who watches.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from ..kvcache import KVCache
from ..models.llama import CausalLM
from ..models.prefill import MIN_BUCKET, PromptBatch, prompt_bucket
from ..sampling import RowSampling, SamplingParams
from ..transfer import to_device, zero_rows
from .graphs import SPAN, GraphRunner, graphable, span
from .observer import StepObserver
from .plain import PlainStep


@dataclass
class Slots:
    """The per-row device state all steps of one decoder read and write (steps keep their own
    beside it)."""
    cache: KVCache
    limit: torch.Tensor  # (B,) tokens row b may still emit; 0 freezes it
    last: torch.Tensor  # (B,) each row's last emitted token: the next step's input
    sampling: RowSampling  # each row's sampling settings and random stream
    stops: torch.Tensor  # (B,) bool: the row stops at an EOS token
    eos: torch.Tensor  # (E,) the EOS token ids (shared by every row)

    @property
    def batch(self) -> int:
        return self.cache.batch

    def rows(self, k: int) -> "Slots":
        """Rows 0..k-1 (views: writes land in this storage)."""
        return Slots(self.cache.view(0, k), self.limit[:k], self.last[:k], self.sampling.rows(k), self.stops[:k],
                     self.eos)


class Step(Protocol):
    """What one decoding step does, over a decoder's `slots`. The decoder calls: for an admission
    `prefill` (inside its graph) then `admitted`; per step `launch` on the step over the rows in use
    (`rows(k)`) then, once its output is on the host, `collect` on the whole step; `release` for
    freed rows (on every step it has run)."""
    name: str  # tells this step's graphs apart from other steps' on the same decoder
    slots: Slots
    tokens_per_step: int  # the most tokens a row can emit in one step
    pipelines: bool  # may be launched before the previous step is collected (it needs no host data)

    def rows(self, k: int) -> "Step":
        """This step over rows 0..k-1 (slots.rows(k)): its own graph buffers, the same storage."""

    def room(self) -> list[tuple[KVCache, int]]:
        """Each cache the step writes (the target's first) and how many slots past a row's
        committed length one step may touch in it."""

    def prefill(self, batch: PromptBatch) -> torch.Tensor:
        """The device part of admitting `batch` (graph-safe): each prompt's first token (b,)."""

    def admitted(self, rows: list[int], prompts: list[list[int]], first: list[int]) -> None:
        """The host part of an admission, once the first tokens are known."""

    def launch(self, graphs: GraphRunner, key: tuple, observer: StepObserver) -> torch.Tensor:
        """Enqueue one step (its graphs keyed by (phase, *key)); returns its packed output."""

    def collect(self, rows: list[list[int]], same: list[bool], live: np.ndarray,
                observer: StepObserver) -> list[list[int]]:
        """The host's part of a step: `rows` is its packed output per row (zeros past its rows),
        `same[b]` whether row b still holds the sequence it held at launch, `live[b]` whether the
        host still wants its tokens. Returns each row's emitted tokens."""

    def release(self, rows: list[int]) -> None:
        """These rows' sequences are gone."""


@dataclass(eq=False)
class Firsts:
    """An admission's first tokens on their way to the host: its rows, the pinned copy, each row's
    epoch at admission (a row released since gets nothing) and the copy's event."""
    rows: list[int]
    host: torch.Tensor
    epoch: np.ndarray
    done: torch.cuda.Event | None

    def tokens(self, epoch: np.ndarray) -> list[tuple[int, int]]:
        """(row, first token) of the rows still holding the admitted sequence (after `done`)."""
        return [(r, t) for r, t, e in zip(self.rows, self.host.tolist(), self.epoch) if epoch[r] == e]


@dataclass
class InFlight:
    """A launched step: its packed output (on the host once `done` has passed) and each row's epoch
    when it was launched."""
    out: torch.Tensor
    done: torch.cuda.Event | None
    epoch: np.ndarray


WARM_PREFILL_TOKENS = 16384  # warm-up captures prefills of several rows up to this many (padded) tokens
# one request of each sampling mode (sampling.Mode: greedy, sampled, sampled with a cut), whose
# steps' graphs differ
WARM_SETTINGS = (SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=50))


def warm_prompt(n: int) -> list[int]:
    """A prompt of n tokens for warm-up (what it says does not matter)."""
    return [(i % 50) + 1 for i in range(n)]


def row_buckets(batch: int) -> list[int]:
    """The row counts steps run over: powers of two below `batch`, then `batch`."""
    out = [1]
    while out[-1] * 2 < batch:
        out.append(out[-1] * 2)
    return out + [batch] if batch > 1 else out


def prefill_shape(prompts: int, longest: int, batch: int, max_len: int) -> tuple[int, int]:
    """(rows, padded length) of the prefill that admits `prompts` prompts, the longest `longest`
    tokens: the row bucket that holds them and the length bucket, so a server meets a few dozen
    prefill graphs, all captured at warm-up, not one per count of prompts admitted together."""
    return next(b for b in row_buckets(batch) if b >= prompts), prompt_bucket(longest, max_len)


class Decoder:
    def __init__(self, model: CausalLM, batch: int, max_len: int, graphs: bool = True, lookahead: bool | None = None,
                 observer: StepObserver | None = None, eos: frozenset[int] = frozenset()):
        """`eos`: the token ids a row admitted with stops=True stops at on the device."""
        p = next(model.parameters())
        self.device = p.device
        cache = KVCache.for_model(model.config, batch, max_len, p.dtype, p.device)
        zeros = lambda: torch.zeros(batch, dtype=torch.long, device=p.device)  # noqa: E731
        eos_d = torch.tensor(sorted(eos), dtype=torch.long, device=p.device)
        self.slots = Slots(cache, zeros(), zeros(), RowSampling(batch, p.device, cache.lens), zeros().bool(), eos_d)
        self.graphs = GraphRunner(p.device, graphs and graphable(model))
        self.graph_prefill = not model.kernels.exact  # each row over its own prompt length: host shapes
        self.observer = observer or StepObserver()
        self.epoch = np.zeros(batch, dtype=np.int64)  # bumped when a row is admitted or released
        self.live = np.zeros(batch, dtype=bool)  # rows the host last gave a limit > 0
        self.in_flight: deque[InFlight] = deque()
        self.trip = 1  # steps `advance` launches back to back and collects together
        self.rate = 1.0  # tokens a running row has emitted a step, lately (how many steps a budget needs)
        self.trips: deque[int] = deque()  # the steps of each trip in flight not yet collected, oldest first
        self.firsts: list[Firsts] = []  # admissions whose first tokens are not handed out yet
        self._views: dict[tuple[int, int], Step] = {}  # (id of a step, k) -> that step over rows 0..k-1
        self._prompts: dict[tuple[int, int], PromptBatch] = {}  # each prefill graph's input buffers
        self._hosts: dict[tuple, list] = {}  # (shape, dtype) -> free host buffers for step outputs, with events
        # launch ahead of collect: on the GPU by default (on the CPU a step runs while it is launched)
        self._ahead = p.device.type == "cuda" if lookahead is None else lookahead
        self._device_wait = 0.0  # seconds the host has spent blocked on the device's results
        self.plain = PlainStep(model, self.slots)
        self.current: Step = self.plain  # the step that launches run
        self._used: list[Step] = [self.plain]  # every step run here: each hears of released rows

    @property
    def cache(self) -> KVCache:
        return self.slots.cache

    @property
    def sampling(self) -> RowSampling:
        return self.slots.sampling

    @property
    def batch(self) -> int:
        return self.slots.batch

    @property
    def lookahead(self) -> bool:
        """Whether the next step may be launched before this one is collected."""
        return self._ahead and self.current.pipelines and not self.observer.needs_proposal

    def use(self, step: Step) -> list[list[list[int]]]:
        """Run `step` (a step over this decoder's slots) from the next launch on; the rows keep
        their sequences. Collects the steps in flight first (the previous step's) and returns their
        tokens per row, oldest step first."""
        if step.slots is not self.slots:
            raise ValueError("use: the step runs over another decoder's rows")
        done = [self.collect() for _ in range(len(self.in_flight))]
        if done:  # first tokens whose copy those steps followed go before their tokens
            self._first_tokens_first(self._ready_firsts(), done[0])
        if all(s is not step for s in self._used):
            self._used.append(step)
        self.current = step
        return done

    def take_device_wait(self) -> float:
        """The seconds the host has spent blocked on the device's results since the last call."""
        w, self._device_wait = self._device_wait, 0.0
        return w

    def set_rows(self, rows: list[int], limits: list[int]) -> None:
        """Set these rows' token limits (device, stream-ordered after the steps already launched)."""
        if not rows:
            return
        self.live[rows] = np.asarray(limits) > 0
        rows_d, value_d = to_device(np.array([rows, limits], dtype=np.int64), torch.long, self.device)
        self.slots.limit.index_copy_(0, rows_d, value_d)

    def spans(self, room: list[tuple[KVCache, int]]) -> tuple[int, ...]:
        """Fix the attention span of this step's caches (part of every graph key): each (cache, r)
        in `room` needs r slots past its longest row. All get one span, the largest any needs (each
        capped at its own size): were they spanned apart, a row near a span's end would meet a mix
        of spans that warm-up never captures. The host's lengths lag by the steps in flight, each of
        which may add tokens_per_step per row."""
        lag = len(self.in_flight) * self.current.tokens_per_step
        need = max(int(c.host_lens.max()) + r for c, r in room) + lag
        out = []
        for c, _ in room:
            c.kv_limit = span(need, c.max_len)
            out.append(c.kv_limit)
        return tuple(out)

    # ---- rows in use ----
    def rows_in_use(self) -> int:
        """The bucket of rows a step must cover: every row the host has given tokens to emit (all
        of them for an observer that reads whole-batch proposals)."""
        if self.observer.needs_proposal:
            return self.batch
        live = np.flatnonzero(self.live)
        n = int(live[-1]) + 1 if len(live) else 1
        return next(b for b in row_buckets(self.batch) if b >= n)

    def prefix(self, k: int) -> Step:
        """The step in use over rows 0..k-1 (made once per step and k, and kept: its captured
        graphs read its own buffers)."""
        step = self.current
        if k == self.batch:
            return step
        key = (id(step), k)
        if key not in self._views:
            self._views[key] = step.rows(k)
        return self._views[key]

    # ---- steps ----
    def launch(self) -> None:
        """Enqueue one step of every row with tokens left; its output starts for the host."""
        step = self.prefix(self.rows_in_use())
        mode = self.sampling.choose_mode(np.flatnonzero(self.live))
        key = (step.slots.batch, *self.spans(step.room()), step.name, mode)
        out = step.launch(self.graphs, key, self.observer)
        self.in_flight.append(InFlight(*self._to_host(out), self.epoch.copy()))

    def _to_host(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """t's copy on its way to the host (buffer, its event; None on the CPU), in a buffer given back."""
        free = self._hosts.setdefault((t.shape, t.dtype), [])
        host, done = free.pop() if free else (torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda),
                                              torch.cuda.Event() if t.is_cuda else None)
        host.copy_(t, non_blocking=t.is_cuda)
        if done is not None:  # an event per buffer, recorded again: no event made and destroyed a step
            done.record()
        return host, done

    def _give_back(self, host: torch.Tensor, done: torch.cuda.Event | None) -> None:
        """A host buffer the host has read (after its copy's event `done`): the next copy of its shape
        fills it and records that event again."""
        self._hosts[(host.shape, host.dtype)].append((host, done))

    def collect(self) -> list[list[int]]:
        """Wait for the oldest step in flight; each row's emitted tokens ([] for a frozen row, and
        for one released or re-admitted since the launch). A row the host has frozen since the
        launch still gets its tokens (the caches hold them); `live` says whether they count."""
        f = self.in_flight.popleft()
        if self.trips:
            self.trips[0] -= 1
            if not self.trips[0]:
                self.trips.popleft()
        if f.done is not None:
            t = time.perf_counter()
            f.done.synchronize()  # sync: the one per step
            self._device_wait += time.perf_counter() - t
        rows = f.out.tolist()
        self._give_back(f.out, f.done)
        rows += [[0] * len(rows[0])] * (self.batch - len(rows))  # rows past the step's prefix: frozen
        out = self.current.collect(rows, (self.epoch == f.epoch).tolist(), self.live, self.observer)
        running = [len(t) for t, on in zip(out, self.live) if on and t]
        if running:
            self.rate = 0.8 * self.rate + 0.2 * sum(running) / len(running)
        return out

    def _take_firsts(self) -> list[list[int]]:
        """The first tokens of admissions no step has carried (nothing was launched after them)."""
        out = [[] for _ in range(self.batch)]
        for firsts in self.firsts:
            if firsts.done is not None:
                firsts.done.synchronize()  # sync: the first tokens
            for r, tok in firsts.tokens(self.epoch):
                out[r].append(tok)
            self._give_back(firsts.host, firsts.done)
        self.firsts = []
        return out

    def advance(self, remaining: list[int], trip: int | None = None) -> list[list[int]] | None:
        """One turn of a decode loop, given the tokens each row still wants (0: stopped or free).
        Launches a trip of up to `trip` steps, as many as the largest budget is expected to need
        beyond the steps in flight (at `rate` tokens a step: a speculating row's budget ends in
        fewer steps than tokens, and a step launched past the end is wasted), then collects the oldest
        trip once the lookahead allows, or at once when nothing was launched. Returns that trip's
        tokens per row (its steps' in order), an empty list per row while the pipeline fills, and
        None when nothing is left to run. `trip` overrides the trip's length (a caller about to
        admit prompts, whose prefill waits for the steps in flight, launches a short one)."""
        early = self._ready_firsts()  # first tokens already on the host go out now
        need = -(-max(remaining, default=0) // max(self.rate, 1.0))  # steps the longest budget needs, expected
        n = min(trip or self.trip, int(need) - len(self.in_flight))
        for _ in range(n):
            self.launch()
        if n > 0:
            self.trips.append(n)
        if not self.in_flight:
            out = self._take_firsts() if self.firsts else None
        elif n > 0 and len(self.trips) <= (1 if self.lookahead else 0):
            out = [[] for _ in range(self.batch)]
        else:
            steps = self.trips[0] if self.trips else 1
            out = self.collect()
            for _ in range(steps - 1):  # the rest of the trip
                for row, toks in zip(out, self.collect()):
                    row += toks
            early += self._ready_firsts()  # copies enqueued before the steps just collected are done
        return self._first_tokens_first(early, out)

    def _first_tokens_first(self, early: list[tuple[int, int]], out: list[list[int]] | None):
        """Each (row, first token) put before the row's tokens of the steps after its admission."""
        if early:
            out = out or [[] for _ in range(self.batch)]
            for r, tok in early:
                out[r].insert(0, tok)
        return out

    def _ready_firsts(self) -> list[tuple[int, int]]:
        """(row, first token) of the admissions not yet handed out whose copy to the host is done
        (a query, no wait): a first token goes out as soon as it is there, at the latest with the
        step after its admission (stream order)."""
        ready = [f for f in self.firsts if f.done is None or f.done.query()]
        self.firsts = [f for f in self.firsts if f not in ready]
        out = [t for f in ready for t in f.tokens(self.epoch)]
        for f in ready:
            self._give_back(f.host, f.done)
        return out

    def drain(self) -> None:
        """Collect and drop every step in flight."""
        while self.in_flight:
            self.collect()

    def step(self, limit: list[int]) -> list[list[int]]:
        """One synchronous step: row b emits at most limit[b] tokens (0: frozen)."""
        self.drain()
        self.set_rows(list(range(self.batch)), limit)
        self.launch()
        return self.collect()

    def admit(self, rows: list[int], prompts: list[list[int]], sampling: list[SamplingParams] | None = None,
              streams: list[int] | None = None, stops: list[bool] | None = None,
              wait: bool = True) -> list[list[int]] | None:
        """Prefill prompts into the given free rows, each with its sampling settings (default:
        greedy), random stream (default: SamplingParams.stream: its seed's, else a fresh one) and
        whether the device stops it at EOS (default: no); returns each one's first token. With
        wait=False and lookahead, nothing waits for the device: `advance` hands the first tokens
        out once their copy to the host is done (first in their rows' lists), at the latest with
        the next step's, and None is returned (a server admitting beside running rows keeps the
        steps in flight on their way)."""
        if self.cache.host_lens[rows].any():
            raise RuntimeError(f"admit: rows {rows} are not free")
        sampling = sampling or [SamplingParams()] * len(rows)
        streams = streams or [p.stream() for p in sampling]
        self.epoch[rows] += 1
        self.sampling.set(rows, sampling, streams)
        flags = to_device(np.array([rows, stops or [False] * len(rows)], dtype=np.int64), torch.long, self.device)
        self.slots.stops.index_copy_(0, flags[0], flags[1].bool())
        self.sampling.mode.general()  # a prefill draws its few first tokens on the one path right for any row
        step = self.current
        shape = prefill_shape(len(rows), max(map(len, prompts)), self.batch, self.cache.max_len)
        if shape not in self._prompts:
            self._prompts[shape] = PromptBatch.alloc(*shape, self.device)
        pad = shape[0] - len(rows)  # the last prompt again into its own row: the same writes twice
        batch = self._prompts[shape].fill(prompts + [prompts[-1]] * pad, rows + [rows[-1]] * pad)
        with self.observer.phase("prefill"):
            first = self.graphs.run(("prefill", *shape, step.name), lambda: step.prefill(batch),
                                    graph=self.graph_prefill)[:len(rows)]
            if not wait and self.lookahead:
                host, done = self._to_host(first)
                self.firsts.append(Firsts(list(rows), host, self.epoch[rows].copy(), done))
                first = None
            else:
                t = time.perf_counter()
                first = first.tolist()  # sync: first tokens
                if self.device.type == "cuda":
                    self._device_wait += time.perf_counter() - t
        self.cache.host_lens[rows] = [len(p) for p in prompts]
        step.admitted(rows, prompts, first)
        return None if first is None else [[t] for t in first]

    def release(self, rows: list[int]) -> None:
        """Free rows at once: their cache length drops to 0 and they are frozen."""
        self.epoch[rows] += 1
        self.live[rows] = False
        zero_rows(self.slots.limit, rows)
        self.cache.release(rows)
        for step in self._used:
            step.release(rows)

    def free_all(self) -> None:
        """Drop the steps in flight and free every row."""
        self.drain()
        self.firsts = []
        self.release(list(range(self.batch)))

    # ---- warm-up ----
    def warmup(self, rows: int | None = None, prompt_tokens: int = 1024, plain_rows: int = 0,
               max_span: int = 2048) -> int:
        """Capture, before serving, the graphs that requests would otherwise meet cold (each key's
        first call runs eagerly, its second captures; GPU only, nothing to do without graphs):
        those of the step in use for batches of up to `rows` rows (default: all), then, when
        `plain_rows` is given and the step in use is not plain, the plain step's for up to that
        many (a speculating server batch that grows turns plain). Leaves every row free and the
        same step in use. Returns how many graphs it captured."""
        if not self.graphs.enabled:
            return 0
        before = self.graphs.captured
        self._warm(rows, prompt_tokens, max_span)
        if plain_rows and self.current is not self.plain:
            step = self.current
            self.use(self.plain)
            self._warm(plain_rows, prompt_tokens, max_span)
            self.use(step)
        self.free_all()
        return self.graphs.captured - before

    def _warm(self, rows: int | None, prompt_tokens: int, max_span: int) -> None:
        """The step in use's graphs, for batches of up to `rows` rows: the prefill of every row
        bucket they admit in with every padded length up to `prompt_tokens` (up to
        WARM_PREFILL_TOKENS tokens a prefill past one row; bigger ones are captured when met); and
        for every row bucket they step over, every attention span up to `max_span` (longer spans,
        rarer and costlier to warm, are captured when met) and every sampling mode, two steps."""
        self.free_all()
        cap = self.cache.max_len - self.current.tokens_per_step * 3  # room for two steps and one in flight
        buckets = row_buckets(self.batch)
        last = next(b for b in buckets if b >= min(rows or self.batch, self.batch))  # the one `rows` rows step in
        for r in buckets[:buckets.index(last) + 1]:
            t = MIN_BUCKET
            while t <= min(prompt_tokens, cap) and (r == 1 or r * t <= WARM_PREFILL_TOKENS):
                for _ in range(2):
                    self.admit(list(range(r)), [warm_prompt(t)] * r)
                    self.release(list(range(r)))
                t *= 2
        for k in buckets[:buckets.index(last) + 1]:
            for s in range(SPAN, min(self.cache.max_len, max_span) + 1, SPAN):
                n = s - SPAN + 1  # the longest row's prompt: the steps' span is s
                if n > cap:
                    break
                for params in WARM_SETTINGS:
                    self.admit([0], [warm_prompt(n)], [params])
                    if k > 1:
                        self.admit(list(range(1, k)), [warm_prompt(1)] * (k - 1), [params] * (k - 1))
                    for _ in range(2):
                        self.step([2] * k + [0] * (self.batch - k))
                    self.free_all()
