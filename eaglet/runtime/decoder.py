"""What plain and speculative decoding share: the target's KV cache over `batch` slots, the graph
runner, per-row token limits, steps in flight, and admitting prompts into free rows while other
rows keep going (the server's continuous batching; Generator admits a whole batch at once).

Each row has a token limit on the device: the tokens it may still emit. A step emits at most that
many and subtracts what it emitted, so the host sets a row's limit only when it changes (`set_rows`:
a new request's budget, 0 once the host sees it stop); 0 freezes the row, its cache does not move.

`launch()` enqueues one step and starts its packed output on its way to the host; `collect()` waits
for the oldest step in flight and returns each row's emitted tokens. Nothing else in a step needs the
host, so on the GPU a caller may launch step t+1 before it collects step t (`lookahead`): the host's
work on step t (streaming, stopping, bookkeeping) then overlaps the GPU's work on t+1 instead of
leaving the GPU idle. A row that stops on EOS or a stop string runs one step past it; those tokens
are dropped. A row released or re-admitted while a step was in flight gets nothing from that step
(`epoch`). `step(limit)` is the synchronous form: set every row's limit, launch, collect.

A step runs only over rows 0..k-1, k the smallest bucket (1, 2, 4, ..., batch) that holds every
row with tokens left (`rows_in_use`): a server with room for 64 requests and one running steps one
row, not 64. `prefix(k)` is the decoder over those rows: the same storage, sliced (`row_tensors`,
the caches), with its own graphs.

Admitting prompts is one graphed prefill of any set of free rows (models/prefill.py), keyed by the
number of prompts and their padded length. `warmup()` runs the common keys twice before a server
takes requests, so none meets a graph's eager first call.

Subclasses implement `_prefill` (the device part of an admission: prefill, first token),
`_admitted` (its host part), `_launch` (run one step's graphs, return its packed output) and
`_collect` (the host's part of a step).
"""
from __future__ import annotations

import copy
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch

from ..kvcache import KVCache
from ..models.attention import AttnMeta
from ..models.llama import CausalLM
from ..models.prefill import MIN_BUCKET, PromptBatch, prompt_bucket
from ..sampling import SamplingParams, sample
from .graphs import SPAN, GraphRunner, span
from .timer import PhaseTimer


@dataclass
class InFlight:
    """A launched step: its packed output (on the host once `done` has passed) and each row's epoch
    when it was launched."""
    out: torch.Tensor
    done: torch.cuda.Event | None
    epoch: np.ndarray


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on the device without a sync (a fresh pinned buffer: the caching host
    allocator reuses it only after the copy has run)."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def warm_prompt(n: int) -> list[int]:
    """A prompt of n tokens for warm-up (what it says does not matter)."""
    return [(i % 50) + 1 for i in range(n)]


def row_buckets(batch: int) -> list[int]:
    """The row counts steps run over: powers of two below `batch`, then `batch`."""
    out = [1]
    while out[-1] * 2 < batch:
        out.append(out[-1] * 2)
    return out + [batch] if batch > 1 else out


def row_prefix(obj, k: int):
    """A shallow copy of a decoder or drafter over rows 0..k-1: its `row_tensors` and its `cache`
    (if it has one) sliced (views: writes land in the original's storage)."""
    v = copy.copy(obj)
    for name in obj.row_tensors:
        setattr(v, name, getattr(obj, name)[:k])
    if getattr(obj, "cache", None) is not None:
        v.cache = obj.cache.view(0, k)
    return v


class SlotDecoder:
    tokens_per_step = 1  # the most tokens a row can emit in one step (spans allow for steps in flight)
    row_tensors: tuple[str, ...] = ("limit",)  # per-row device state of a step (sliced by prefix)

    def __init__(self, model: CausalLM, batch: int, max_len: int, sampling: SamplingParams,
                 generator: torch.Generator | None, graphs: bool = True, timer: PhaseTimer | None = None,
                 lookahead: bool | None = None):
        p = next(model.parameters())
        self.model, self.sampling, self.gen, self.timer = model, sampling, generator, timer
        self.device = p.device
        self.cache = KVCache.for_model(model.config, batch, max_len, p.dtype, p.device)
        self.graphs = GraphRunner(p.device, graphs, generator)
        self.limit = torch.zeros(batch, dtype=torch.long, device=p.device)  # tokens row b may still emit
        self.epoch = np.zeros(batch, dtype=np.int64)  # bumped when a row is admitted or released
        self.live = np.zeros(batch, dtype=bool)  # rows the host last gave a limit > 0
        self.in_flight: deque[InFlight] = deque()
        self._views: dict[int, SlotDecoder] = {}  # prefix(k) for each k used
        self._prompts: dict[tuple[int, int], PromptBatch] = {}  # each prefill graph's input buffers
        # launch ahead of collect: on the GPU by default (on the CPU a step runs while it is launched)
        self.lookahead = p.device.type == "cuda" if lookahead is None else lookahead
        self.device_wait = 0.0  # seconds the host has spent blocked on the device's results (the server reads it)

    @property
    def batch(self) -> int:
        return self.cache.batch

    def set_rows(self, rows: list[int], limits: list[int]) -> None:
        """Set these rows' token limits (device, stream-ordered after the steps already launched)."""
        if not rows:
            return
        self.live[rows] = np.asarray(limits) > 0
        mask, value = [False] * self.batch, [0] * self.batch
        for r, n in zip(rows, limits):
            mask[r], value[r] = True, n
        mask_d, value_d = to_device(mask, torch.bool, self.device), to_device(value, torch.long, self.device)
        self.limit.copy_(torch.where(mask_d, value_d, self.limit))

    def span_of(self, cache: KVCache, room: int, *more: tuple[KVCache, int]) -> tuple[int, ...]:
        """Fix the attention span of this step's caches (part of every graph key): `cache` needs
        `room` slots past its longest row, and so each (cache, room) in `more` (a drafter's). All
        get one span, the largest any needs (each capped at its own size): were they spanned apart,
        a row near a span's end would meet a mix of spans that warm-up never captures. The host's
        lengths lag by the steps in flight, each of which may add tokens_per_step per row."""
        lag = len(self.in_flight) * self.tokens_per_step
        need = max(int(c.host_lens.max()) + r for c, r in ((cache, room), *more)) + lag
        out = []
        for c, _ in ((cache, room), *more):
            c.kv_limit = span(need, c.max_len)
            out.append(c.kv_limit)
        return tuple(out)

    # ---- rows in use ----
    def rows_in_use(self) -> int:
        """The bucket of rows a step must cover: every row the host has given tokens to emit."""
        live = np.flatnonzero(self.live)
        n = int(live[-1]) + 1 if len(live) else 1
        return next(b for b in row_buckets(self.batch) if b >= n)

    def prefix(self, k: int) -> "SlotDecoder":
        """This decoder over rows 0..k-1 (made once per k; it shares this one's storage)."""
        if k == self.batch:
            return self
        if k not in self._views:
            self._views[k] = self._make_view(k)
        return self._views[k]

    def _make_view(self, k: int) -> "SlotDecoder":
        return row_prefix(self, k)

    # ---- steps ----
    def launch(self) -> None:
        """Enqueue one step of every row with tokens left; its output starts for the host."""
        out = self.prefix(self.rows_in_use())._launch()
        if out.is_cuda:
            host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
            host.copy_(out, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        else:
            host, done = out.clone(), None
        self.in_flight.append(InFlight(host, done, self.epoch.copy()))

    def collect(self) -> list[list[int]]:
        """Wait for the oldest step in flight; each row's emitted tokens ([] for a frozen row, and
        for one released or re-admitted since the launch). A row the host has frozen since the
        launch still gets its tokens (the caches hold them); `live` says whether they count."""
        f = self.in_flight.popleft()
        if f.done is not None:
            t = time.perf_counter()
            f.done.synchronize()  # sync: the one per step
            self.device_wait += time.perf_counter() - t
        rows = f.out.tolist()
        rows += [[0] * len(rows[0])] * (self.batch - len(rows))  # rows past the step's prefix: frozen
        return self._collect(rows, (self.epoch == f.epoch).tolist())

    def advance(self, remaining: list[int]) -> list[list[int]] | None:
        """One turn of a decode loop, given the tokens each row still wants (0: stopped or free).
        Launches a step if some row may want one beyond the steps in flight (each brings at least
        one token to every running row), then collects the oldest step once the lookahead allows,
        or at once when nothing was launched. Returns that step's tokens per row, an empty list
        per row while the pipeline fills, and None when nothing is left to run."""
        launched = any(n > len(self.in_flight) for n in remaining)
        if launched:
            self.launch()
        if not self.in_flight:
            return None
        if launched and len(self.in_flight) <= (1 if self.lookahead else 0):
            return [[] for _ in range(self.batch)]
        return self.collect()

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

    def _launch(self) -> torch.Tensor:
        raise NotImplementedError

    def _launch_plain(self, last: torch.Tensor) -> torch.Tensor:
        """Enqueue one plain step, each row fed its token in `last` (one graph per row bucket and
        attention span); returns (B, 2): each row's token and whether it emitted one."""
        kv, = self.span_of(self.cache, 1)
        with self.phase("decode"):
            return self.graphs.run(("decode", self.batch, kv), lambda: self._decode(last))

    def _decode(self, last: torch.Tensor) -> torch.Tensor:
        """Feed each row's last token, sample the next; frozen rows (limit 0) do not move."""
        c, model = self.cache, self.model
        positions = c.lens[:, None]  # (B, 1)
        meta = AttnMeta.build(c.lens, positions, c.kv_len(1), sliding_window=model.config.sliding_window)
        hidden, _ = model(last[:, None], positions, c, meta)
        tok = sample(model.logits(hidden[:, -1]), self.sampling, self.gen)  # (B,)
        on = self.limit > 0
        active = on.long()
        last.copy_(torch.where(on, tok, last))
        c.lens += active
        self.limit -= active
        return torch.stack([last, active], 1)

    def _collect_plain(self, rows: list[list[int]], same: list[bool]) -> list[list[int]]:
        emitted = [[tok] if active and ok else [] for (tok, active), ok in zip(rows, same)]
        self.cache.commit_host([len(e) for e in emitted])
        return emitted

    def _collect(self, rows: list[list[int]], same: list[bool]) -> list[list[int]]:
        raise NotImplementedError

    def phase(self, name: str):
        return self.timer.phase(name) if self.timer else nullcontext()

    def admit(self, rows: list[int], prompts: list[list[int]]) -> list[list[int]]:
        """Prefill prompts into the given free rows; returns each one's first token."""
        if self.cache.host_lens[rows].any():
            raise RuntimeError(f"admit: rows {rows} are not free")
        self.epoch[rows] += 1
        shape = (len(rows), prompt_bucket(max(map(len, prompts)), self.cache.max_len))
        if shape not in self._prompts:
            self._prompts[shape] = PromptBatch.alloc(*shape, self.device)
        batch = self._prompts[shape].fill(prompts, rows)
        with self.phase("prefill"):
            first = self.graphs.run(self._prefill_key(shape), lambda: self._prefill(batch))
            t = time.perf_counter()
            first = first.tolist()  # sync: first tokens
            if self.device.type == "cuda":
                self.device_wait += time.perf_counter() - t
        self.cache.host_lens[rows] = [len(p) for p in prompts]
        self._admitted(rows, prompts, first)
        return [[t] for t in first]

    def _prefill_key(self, shape: tuple[int, int]) -> tuple:
        return ("prefill",) + shape

    def _prefill(self, batch: PromptBatch) -> torch.Tensor:
        """The device part of admitting `batch` (graph-safe): each prompt's first token (b,)."""
        raise NotImplementedError

    def _admitted(self, rows: list[int], prompts: list[list[int]], first: list[int]) -> None:
        """The host part of an admission, once the first tokens are known."""

    def release(self, rows: list[int]) -> None:
        """Free rows at once: their cache length drops to 0 and they are frozen."""
        self.epoch[rows] += 1
        self.set_rows(rows, [0] * len(rows))
        self.cache.release(rows)

    def reset(self) -> None:
        self.free_all()

    def free_all(self) -> None:
        """Drop the steps in flight and free every row."""
        self.drain()
        self.release(list(range(self.batch)))

    # ---- warm-up ----
    def warmup(self, rows: int | None = None, prompt_tokens: int = 1024, max_span: int = 2048) -> int:
        """Capture, before serving, the graphs that requests would otherwise meet cold (each key's
        first call runs eagerly, its second captures; GPU only, nothing to do without graphs):
        a prefill of one prompt of every padded length up to `prompt_tokens`, and for every row
        bucket that a batch of up to `rows` rows (default: all) steps over, and every attention span
        up to `max_span`, a prefill and two steps (longer spans, rarer and costlier to warm, are
        captured when met). Leaves every row free. Returns how many graphs it captured."""
        if not self.graphs.enabled:
            return 0
        before = self.graphs.captured
        self.free_all()
        cap = self.cache.max_len - self.tokens_per_step * 3  # room for two steps and one in flight
        t = MIN_BUCKET
        while t <= min(prompt_tokens, cap):
            for _ in range(2):
                self.admit([0], [warm_prompt(t)])
                self.release([0])
            t *= 2
        buckets = row_buckets(self.batch)
        last = next(b for b in buckets if b >= min(rows or self.batch, self.batch))  # the one `rows` rows step in
        for k in buckets:
            if k > last:
                break
            for s in range(SPAN, min(self.cache.max_len, max_span) + 1, SPAN):
                n = s - SPAN + 1  # the longest row's prompt: the steps' span is s
                if n > cap:
                    break
                self.admit([0], [warm_prompt(n)])
                if k > 1:
                    self.admit(list(range(1, k)), [warm_prompt(1)] * (k - 1))
                for _ in range(2):
                    self.step([2] * k + [0] * (self.batch - k))
                self.free_all()
        return self.graphs.captured - before
