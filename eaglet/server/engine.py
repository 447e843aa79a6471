"""The engine thread: one thread owns the model and the Batcher (in the server's process, or in a
process of its own: remote.py); the HTTP side (asyncio) only appends to a bounded waiting queue
under a lock and reads each request's asyncio.Queue, which the engine fills through
loop.call_soon_threadsafe, so a request never waits on the model to be accepted or refused.

Loop: apply cancellations (a disconnected client's row is released at the next step boundary,
its cache freed at once) -> admit waiting requests into free rows (their first tokens go out at
once) -> one step of every running row -> hand each request its text, finish the finished ones.
The loop times its parts (idle, admit, step, output; the decoder's device waits) and adds them to
the engine_seconds counters every 50 ms and before it waits (metrics.py).

Sampling: every request brings its own settings (temperature, top-k, top-p, seed), held per row on
the device, so requests of any settings share a batch and are served in arrival order. A seeded
request draws from its own counter-based stream: the same text whatever runs beside it.

Speculation (policy.py): a batch decodes plain or with one speculation setting, chosen by the
SpecPolicy when the batch starts from the load: the requests it starts with (those admitted plus
those still waiting, capped at its rows), or the most requests the server held at
once in the last LOAD_WINDOW seconds if that is more: clients that send their next request when
the last one ends leave moments with few requests between batches, where the instant count alone
would start a batch speculating; 30 s spans the gap between one load run and the next. An idle
batch whose choice would now differ is replaced by a new one. When requests wait to join a
speculating batch and the grown batch (running + waiting, capped) is one the policy decodes plain,
or past the setting's reach (SpecPolicy.reach; warm-up captures its graphs that far), the batch turns
plain where it stands (Batcher.use, on the same cache) and takes them in. With --spec-switch one
drafter serves every setting (steps.py), and a batch that grows into a size the policy gives another
setting predicted MOVE_OVER times as fast moves to it in place (Batcher.use), with no prefill (SpecPolicy.move).
One decoder, and so one KV cache of --max-batch rows, serves every batch whatever its setting.

Admissions into a running batch come in groups: each is a prefill and a sync that stalls the
pipelined steps (~6 ms on the H200 at 64 speculating rows), and speculating rows finish at
staggered steps, so admitting each request as it came made hundreds of one-request prefills a run
(528 for 1024 requests at 64 streams, 45% of the engine's time). A running batch admits once the
requests waiting to join number 1/ADMIT_SHARE of its running rows (at most its free rows), or the
oldest has waited ADMIT_WAIT; a batch of up to ADMIT_SHARE rows, or an idle one, admits at once.

Failures: an error in one row's output fails that request alone; an error in a step fails the
requests of that batch (the decoder's state is shared) and the engine starts a new batch; any
other error, and under tensor parallelism any error in a step (a collective that failed or timed
out: the ranks may be out of step), stops the engine thread, fails every request, and /health
turns 503. All are logged.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import suppress
from functools import partial

import torch

from ..generate import Generator
from ..runtime.decoder import Decoder, Step
from ..spec.metrics import SpecMetrics
from . import MULTI_STEP
from .batcher import Batcher, Output
from .load import LoadMeter
from .metrics import ENGINE_PARTS, ServerMetrics
from .policy import PLAIN, SpecPolicy, setting_name
from .protocol import APIError
from .request import Chunk, Request, put_all
from .steps import setting_step

log = logging.getLogger("eaglet.server")
ADMIT_SHARE = 8  # a running batch admits once 1/ADMIT_SHARE of its running count waits (or free rows' worth),
ADMIT_WAIT = 0.02  # or once the oldest waiting request has waited this long (seconds)


def graphs_on(generator: Generator) -> bool:
    """Whether the generator's decoders run CUDA graphs (on the GPU, unless --eager)."""
    return generator.graphs and next(generator.model.parameters()).device.type == "cuda"


class Engine:
    def __init__(self, generator: Generator, slots: int, max_queue: int, max_len: int, metrics: ServerMetrics,
                 policy: SpecPolicy | None = None, multi_step: int | None = None, spec_multi_step: int = 1,
                 channel=None):
        """`generator` decodes with its own speculator (or plain); `policy` (default: always that)
        picks plain or a setting of its base speculator per batch; `multi_step`: plain decoding
        steps a host round trip (Decoder.trip; default MULTI_STEP on the GPU, 1 on the CPU), and
        `spec_multi_step` speculation steps. `channel` (dist/follow.py): rank 0 of tensor-parallel
        ranks, whose decoder calls are sent to the other ranks first."""
        self.generator, self.slots, self.max_queue, self.max_len = generator, slots, max_queue, max_len
        self.multi_step, self.spec_multi_step = multi_step, spec_multi_step
        self.metrics = metrics
        self.policy = policy or SpecPolicy(generator.speculator)
        own = generator.speculator
        self.home = None if own is None else setting_name(own.spec)  # the generator's own setting
        self.channel = channel
        self.dec: Decoder | None = None  # every batch's rows and cache (made at the first batch or warm-up)
        self.steps: dict[str, Step] = {}  # speculation setting -> its step on self.dec
        self.setting: str | None = None  # the current batch's setting
        self.chosen = False  # a batch has started (self.setting means something)
        self.switch = False  # the speculating batch moves to self.setting (None: plain) before the next admission
        self.cond = threading.Condition()
        self.waiting: deque[Request] = deque()
        self.cancels: list[Request] = []
        self.batcher: Batcher | None = None
        self.outbox: list[tuple[Request, Chunk, bool]] = []  # engine thread: chunks to send this iteration
        self.load = LoadMeter()  # engine thread, under the lock
        # engine thread: its time by part (metrics.ENGINE_PARTS), steps and admissions, not yet in the metrics
        self.time, self.time_steps, self.time_admits, self.time_pushed = dict.fromkeys(ENGINE_PARTS, 0.0), 0, 0, 0.0
        self.idle_since: float | None = None  # under the lock: when the engine began waiting for work
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="eaglet-engine", daemon=True)
        metrics.kv(0, slots * max_len)
        self.name = metrics.name  # the served model's

    def describe(self) -> str:
        return self.policy.describe(self.slots)

    # what the HTTP side needs besides the engine (an engine process sends it: remote.py)
    tokenizer = property(lambda self: self.generator.tokenizer)
    vocab = property(lambda self: self.generator.model.config.vocab_size)

    def warmup(self) -> int:
        """Before the first request (GPU, graphs on): capture the CUDA graphs of every decoder the
        policy can choose, for greedy requests, so no request meets a graph's eager first call
        (Decoder.warmup). A setting chosen for batches of up to n requests is warmed for n
        rows, and for every row in plain mode (its batch may grow and turn plain). Returns how
        many graphs were captured."""
        if not graphs_on(self.generator):
            return 0
        captured = 0
        with torch.inference_mode():
            for setting in self.settings():
                dec = self.decoder()
                dec.use(self.step(setting))
                captured += dec.warmup() if setting is None else dec.warmup(
                    rows=self.policy.reach(setting, self.slots), plain_rows=self.slots)
        return captured

    def settings(self) -> list[str | None]:
        """Every setting the policy can choose (None: plain)."""
        return list(dict.fromkeys(self.policy.choose(n) for n in range(1, self.slots + 1)))

    def decoder(self) -> Decoder:
        """The one decoder: --max-batch rows, each with room for a request and the most nodes any
        setting drafts."""
        if self.dec is None:
            g = self.generator
            drafted = [self.policy.speculator(s).spec.draft_tokens for s in self.settings() if s is not None]
            self.dec = Decoder(g.model, self.slots, self.max_len + max(drafted, default=0), g.graphs, g.lookahead,
                               g.observer, g.eos_ids())
            if self.channel is not None:  # tensor-parallel rank 0: the other ranks make each call too
                from ..dist.follow import Leader

                self.dec = Leader(self.dec, self.steps, self.channel)
            self.dec.trip = self.multi_step or (MULTI_STEP if self.dec.device.type == "cuda" else 1)
        return self.dec

    def step(self, setting: str | None) -> Step:
        """The step of a setting on the one decoder (None: its plain step), made when first chosen."""
        dec = self.decoder()
        if setting is None:
            return dec.plain
        if setting not in self.steps:
            name = "spec" if setting == self.home else f"spec {setting}"
            self.steps[setting] = setting_step(self.policy, self.generator.model, dec.slots, self.max_len, setting, name,
                                               self.steps, self.settings(), self.shared_drafter)
        return self.steps[setting]

    # one drafter for every setting (--spec-switch), not across tensor-parallel ranks (their own steps)
    shared_drafter = property(lambda self: self.policy.switch and self.channel is None)

    # ---- HTTP side (event loop) -----------------------------------------------------------------

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Stop at the next step boundary: waiting and running requests get 503, /health too."""
        with self.cond:
            self.stopping = True
            self.cond.notify()

    def shutdown(self, timeout: float = 10.0) -> None:
        self.stop()
        self.thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and not self.stopping

    def open(self, req: Request) -> None:
        """Queue `req` (raises APIError 429 when the queue is full, 503 when the engine is dead);
        then read it with `chunks`. Call from the event loop."""
        req.loop, req.queue, req.arrival = asyncio.get_running_loop(), asyncio.Queue(), time.perf_counter()
        self.submit(req)

    async def chunks(self, req: Request) -> AsyncIterator[Chunk]:
        """An opened request's chunks. Leaving early (the client went away, the task was
        cancelled, the consumer closed the generator) cancels the request."""
        try:
            while True:
                chunk = await req.queue.get()
                # the engine got ahead of this stream (the event loop was busy): one chunk for all
                # it has, so a loaded server sends fewer, larger events
                while not (chunk.finish_reason or chunk.error or req.queue.empty()):
                    nxt = req.queue.get_nowait()
                    if nxt.error:  # the text before an error still goes out first
                        yield chunk
                        chunk = nxt
                        break
                    chunk = chunk.then(nxt)
                yield chunk
                if chunk.finish_reason or chunk.error:
                    return
        finally:
            if not req.done:
                self.cancel(req)

    def submit(self, req: Request) -> None:
        with self.cond:
            if not self.alive:
                self.metrics.request_rejected.labels(self.metrics.name).inc()
                raise APIError(503, "the engine is not running", "server_error", code="engine_dead")
            if len(self.waiting) >= self.max_queue:
                self.metrics.request_rejected.labels(self.metrics.name).inc()
                raise APIError(429, f"the server is busy: {len(self.waiting)} requests are waiting "
                                    f"(--max-queue {self.max_queue}); retry later", "rate_limit_error",
                               code="queue_full")
            self.waiting.append(req)
            self.metrics.waiting.labels(self.metrics.name).set(len(self.waiting))
            self.cond.notify()

    def cancel(self, req: Request) -> None:
        with self.cond:
            if req.done:
                return
            req.done = True
            self.metrics.request_aborted.labels(self.metrics.name).inc()
            with suppress(ValueError):
                self.waiting.remove(req)  # not started: nothing else to free
                self.metrics.waiting.labels(self.metrics.name).set(len(self.waiting))
                return
            self.cancels.append(req)  # running: the engine releases its row
            self.cond.notify()

    # ---- engine thread --------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            with torch.inference_mode():  # thread-local: set in the thread that runs the model
                self._loop()
        except BaseException:
            log.exception("the engine thread stopped")
        finally:
            with self.cond:
                self.stopping = True
                failed = list(self.waiting) + [s.request for s in (self.batcher.rows if self.batcher else [])
                                               if s is not None]
                self.waiting.clear()
            for req in failed:
                self._fail(req, APIError(503, "the engine stopped", "server_error", code="engine_dead"))
            self._flush()

    def _loop(self) -> None:
        clock = time.perf_counter
        while True:
            with self.cond:
                while not (self.stopping or self.waiting or self.cancels or (self.batcher and self.batcher.running)):
                    self._push_time()  # nothing is held back while the engine waits
                    self.idle_since = clock()
                    self.cond.wait()
                if self.stopping:
                    return
                woke, idle = clock(), 0.0
                if self.idle_since is not None:  # what sync_idle has not counted yet
                    idle, self.idle_since = woke - self.idle_since, None
                cancels, self.cancels = self.cancels, []
                self.load.note(len(self.waiting) + (self.batcher.running if self.batcher else 0))
                new, admit, setting, n = self.next_admission()
                short = self.admits_next(len(admit))
                switch, self.switch = self.switch, False
                self.metrics.waiting.labels(self.metrics.name).set(len(self.waiting))
            if cancels and self.batcher is not None:
                self.batcher.release_rows([req.row for req in cancels if req.row is not None])
            if switch and self.batcher is not None:
                running = [s.request for s in self.batcher.rows if s is not None]
                self._guarded(partial(self.batcher.use, self.step(self.setting)), running, drop_batch=True)
            t = {"idle": idle, "admit": 0.0, "step": 0.0, "output": 0.0}
            if admit:
                t0 = clock()
                self._guarded(partial(self._admit, new, admit, setting, n), admit, drop_batch=False)
                t1 = clock()
                self._gauges()
                self._flush()  # the first tokens go out now, not after the step below (time to first token)
                t["admit"], t["output"] = t1 - t0, clock() - t1
            stepped = self.batcher is not None and self.batcher.running
            if stepped:
                t0 = clock()
                running = [s.request for s in self.batcher.rows if s is not None]
                # speculating batches take spec_multi_step steps a trip (default 1: each step already
                # brings several tokens a row; trips of 4 measured no gain but 2-7x the time to first token)
                trip = 1 if short else self.spec_multi_step if self.batcher.speculative else None
                self._guarded(partial(self.batcher.step, trip), running, drop_batch=True)
                t["step"] = clock() - t0
            t0 = clock()
            self._gauges()  # before the chunks go out: a client that saw its last chunk sees its row free
            self._flush()
            end = clock()
            t["output"] += end - t0
            t["other"] = max(0.0, end - woke - t["admit"] - t["step"] - t["output"])
            t["device_wait"] = self._device_wait()
            for part, x in t.items():
                self.time[part] += x
            self.time_steps += bool(stepped)
            self.time_admits += bool(admit)
            if end - self.time_pushed > 0.05:  # a few counter updates every 50 ms, not every iteration
                self._push_time()

    async def metrics_text(self) -> bytes:
        """The Prometheus text of /metrics."""
        return self.metrics_text_now()

    def metrics_text_now(self) -> bytes:
        self.sync_idle()  # the engine's wait so far counts now, not when it next wakes
        return self.metrics.render()

    def sync_idle(self) -> None:
        """Count the engine's wait so far (the HTTP side calls it before /metrics is rendered): a
        scrape after a run, and one before the next, then split the wait between runs right."""
        with self.cond:
            if self.idle_since is not None:
                now = time.perf_counter()
                self.metrics.engine({"idle": now - self.idle_since}, 0, 0)
                self.idle_since = now

    def _push_time(self) -> None:
        """The engine time gathered since the last push, to its Prometheus counters."""
        self.metrics.engine(self.time, self.time_steps, self.time_admits)
        drafted = SpecMetrics()  # the draft counters of every speculating step since the last push
        for step in self.steps.values():
            drafted.merge(step.take_drafted())
        self.metrics.drafted(drafted)
        if self.dec is not None:
            self.metrics.graphs.labels(self.metrics.name).set(self.dec.graphs.captured)
        self.time, self.time_steps, self.time_admits = dict.fromkeys(ENGINE_PARTS, 0.0), 0, 0
        self.time_pushed = time.perf_counter()

    def _device_wait(self) -> float:
        """The seconds the current batch's decoder has spent blocked on the device since last asked."""
        return self.batcher.dec.take_device_wait() if self.batcher is not None else 0.0

    def next_admission(self) -> tuple[bool, list[Request], str | None, int]:
        """Under the lock: whether a new batch starts (else the current one takes the requests),
        the requests to admit in arrival order, and for a new batch its setting (None: plain) and
        the request count the policy chose it by."""
        if not self.waiting:
            return False, [], None, 0
        idle = self.batcher is None or not self.batcher.running
        run = min(len(self.waiting), self.slots)  # the requests that could join now
        if not idle:
            free = len(self.batcher.free_rows)
            enough = min(free, -(-self.batcher.running // ADMIT_SHARE))
            if run < enough and time.perf_counter() - self.waiting[0].arrival < ADMIT_WAIT:
                return False, [], None, 0  # a larger group soon: one prefill (and one sync) for several
            load = min(self.slots, self.batcher.running + run)
            choice = self.policy.choose(load)
            reach = self.policy.reach(self.setting, self.slots) if self.setting is not None else self.slots
            target = choice if load > reach else self.policy.move(self.setting, load) if self.setting else None
            if target is not None and self.shared_drafter:
                log.info("the speculating batch (%s) grows to %d requests: it moves to %s", self.setting, load, target)
                self.switch, self.setting = True, target
                self.metrics.policy(target, load)
            elif self.setting is not None and (choice is None or load > reach):
                why = ("a size the policy decodes plain" if choice is None
                       else f"past the setting's reach ({reach})")
                log.info("the speculating batch (%s) grows to %d requests, %s: it turns plain", self.setting, load, why)
                self.switch, self.setting = True, None
                self.metrics.policy(None, load)
            return False, [self.waiting.popleft() for _ in range(min(free, run))], None, 0
        n = min(self.slots, max(run, self.load.peak()))
        setting = self.policy.choose(n)
        # a batch that turned plain keeps its speculative decoder only while it runs
        keep = (self.batcher is not None and setting == self.setting
                and (setting is not None or not self.batcher.speculative))
        free = len(self.batcher.free_rows) if keep else self.slots
        return not keep, [self.waiting.popleft() for _ in range(min(free, run))], setting, n

    def admits_next(self, admitting: int) -> bool:
        """Under the lock: whether the requests still waiting, once `admitting` more rows are
        taken, will be admitted at the next iteration (a group is ready, or the oldest has waited
        half of ADMIT_WAIT). Its prefill waits for the steps in flight, so the step before it is one
        step, not a trip."""
        b = self.batcher
        if not self.waiting or b is None or len(b.free_rows) <= admitting:
            return False
        enough = -(-(b.running + admitting) // ADMIT_SHARE)
        return len(self.waiting) >= enough or time.perf_counter() - self.waiting[0].arrival > ADMIT_WAIT / 2

    def _admit(self, new: bool, admit: list[Request], setting: str | None, n: int) -> list[Output]:
        if new:
            g = self.generator
            self.batcher = Batcher(self.decoder(), self.step(setting), g.tokenizer, g.eos_ids())
            if not self.chosen or setting != self.setting:
                log.info("a batch of %d request%s starts %s%s", n, "" if n == 1 else "s",
                         "plain" if setting is None else f"speculating with {setting}",
                         f" (was {self.setting or PLAIN})" if self.chosen else "")
            self.setting, self.chosen = setting, True
        if n:  # a batch starts (or an idle one restarts with the same choice)
            self.metrics.policy(setting, n)
        return self.batcher.add(admit)

    def _guarded(self, fn, requests: list[Request], drop_batch: bool) -> None:
        """Run add or step; an exception fails `requests` (and, after a step, drops the batch:
        its shared decoder state is not to be trusted)."""
        try:
            outputs = fn()
        except Exception as e:
            if self.channel is not None:  # tensor-parallel: the ranks may be out of step; the engine stops
                rows = {id(r.request) for r in (self.batcher.rows if self.batcher else []) if r is not None}
                for req in requests:  # those without a row; the engine's exit (_run) fails the rows
                    if id(req) not in rows:  # (not released: that too would be a call on the other ranks)
                        self._fail(req, APIError(503, f"the engine stopped: {e}", "server_error",
                                                 code="engine_dead"))
                raise
            log.exception("decoding failed; failing its %d requests", len(requests))
            if self.batcher is not None:
                self.batcher.release_rows([req.row for req in requests if req.row is not None])
            for req in requests:
                self._fail(req, APIError(500, f"internal error: {type(e).__name__}: {e}", "internal_error"))
            if drop_batch:
                self.batcher = None
            return
        self._deliver(outputs)

    def _deliver(self, outputs: list[Output]) -> None:
        t = time.perf_counter()
        m, name = self.metrics, self.metrics.name
        tokens = 0  # this step's, over all rows: one metrics update
        done = []  # rows to free, at once after the loop
        for o in outputs:
            req = o.seq.request
            if o.error is not None:
                done.append(o.row)
                self._fail(req, APIError(500, f"internal error: {type(o.error).__name__}: {o.error}",
                                         "internal_error"))
                continue
            tokens += o.tokens
            if req.first_at is None:
                req.first_at = t
                m.prompt_tokens.labels(name).inc(len(req.prompt))
                m.ttft.labels(name).observe(t - req.arrival)
            else:
                m.gap(t - req.last_at)
            req.last_at = t
            chunk = Chunk(o.text, o.tokens)
            if o.finished:
                done.append(o.row)
                chunk.finish_reason = o.seq.finish_reason
                chunk.completion_tokens = o.seq.count
                chunk.spec = o.seq.spec if self.batcher.speculative and o.seq.spec.drafts else None
                m.request_success.labels(name, chunk.finish_reason).inc()
                m.e2e.labels(name).observe(t - req.arrival)
                if o.seq.count > 1:
                    m.tpot.labels(name).observe((t - req.first_at) / (o.seq.count - 1))
            self._send(req, chunk, final=o.finished)
        self.batcher.release_rows(done)
        m.step(tokens)

    def _fail(self, req: Request, err: APIError) -> None:
        if err.status >= 500:
            self.metrics.request_failed.labels(self.metrics.name).inc()
        self._send(req, Chunk("", 0, error=err), final=True)

    def _send(self, req: Request, chunk: Chunk, final: bool) -> None:
        self.outbox.append((req, chunk, final))

    def _flush(self) -> None:
        """Hand this iteration's chunks to their event loop: one wake-up of each loop per
        iteration, not one per chunk (each is a write to the loop's self-pipe, and the loop's
        thread then competes with this one for the GIL)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for req, chunk, _ in self.take_outbox():
            by_loop.setdefault(req.loop, []).append((req.queue, chunk))
        for loop, items in by_loop.items():
            with suppress(RuntimeError):  # the event loop is closed (server shutting down)
                loop.call_soon_threadsafe(put_all, items)

    def take_outbox(self) -> list[tuple[Request, Chunk, bool]]:
        """This iteration's chunks of the requests still listened to (a final one marks it done)."""
        items = []
        with self.cond:
            for req, chunk, final in self.outbox:
                if not req.done:  # else cancelled, or finished by an earlier chunk: nobody listens
                    req.done = final
                    items.append((req, chunk, final))
        self.outbox.clear()
        return items

    def _gauges(self) -> None:
        b = self.batcher
        self.metrics.running.labels(self.metrics.name).set(b.running if b else 0)
        self.metrics.kv(b.kv_used if b else 0, self.slots * self.max_len)
