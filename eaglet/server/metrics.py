"""The server's Prometheus metrics, named like vLLM's with the `eaglet:` prefix, so dashboards and
`eaglet plan --metrics-url` read them unchanged. One registry per server (tests run several in one
process). The engine thread updates them; prometheus-client is thread-safe.

Speculation counters: `num_drafts` counts verify steps, `num_draft_tokens` the drafted tokens
they verified, `num_accepted_tokens` the drafted tokens accepted (bonus not counted), and
`num_accepted_tokens_per_pos{position}` those accepted at draft depth position+1 (0-based, as
vLLM). τ = 1 + accepted / drafts.

Speculation policy: `spec_policy_speculating` is 1 while the current batch speculates, 0 while it
decodes plain; `spec_policy_setting{setting}` is 1 for the current batch's setting (chain:S,
tree:S,K,N or plain) and 0 for those chosen before; `spec_policy_batch_size` is the request count
the choice was made by.

Engine time: `engine_seconds{part}` splits the engine thread's wall time: `idle` (waiting for
work), `admit` (prefilling new requests: their first tokens), `step` (one decoding step of the
running rows, and turning its tokens into text), `output` (handing chunks to the event loop) and
`other`; `device_wait` is the part of admit and step spent blocked on the device's results, so
`step` less its share is host work. `engine_steps` counts decoding steps, `engine_admissions`
prefills (each admits one or more requests); `cuda_graphs_captured` counts the CUDA graphs captured
(a capture while serving stalls the steps in flight: warm-up should leave none to capture). Whether a loaded server is bound by its host or by
its device reads from these (`eaglet bench-serve` prints them).

Garbage collection: `gc_pause_seconds{generation}` is the time the process spent in Python's cyclic
garbage collector, which stops every thread (the engine's and the event loop's). The server freezes
what it holds after warm-up (app.py), so a full collection does not walk the model's, the
tokenizer's and the libraries' objects: unfrozen, on a CPU serving probe, that took 225-301 ms a
collection, one in every other 64-stream round (record gc-pauses-cpu-20261201-075220.json).
"""
from __future__ import annotations

import gc
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily

from ..spec.metrics import SpecMetrics

WALL_PARTS = ("idle", "admit", "step", "output", "other")  # they add up to the engine thread's wall time
ENGINE_PARTS = WALL_PARTS + ("device_wait",)  # device_wait: within admit and step
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)


class GCPauses:
    """The process's time in the cyclic garbage collector, per generation (one gc callback for the
    process, however many servers it runs; installed on first use)."""
    seconds = [0.0, 0.0, 0.0]
    collections = [0, 0, 0]
    _start: float | None = None
    _lock = threading.Lock()
    _installed = False

    @classmethod
    def install(cls) -> None:
        with cls._lock:
            if not cls._installed:
                gc.callbacks.append(cls._callback)
                cls._installed = True

    @classmethod
    def _callback(cls, phase: str, info: dict) -> None:
        if phase == "start":
            cls._start = time.perf_counter()
        elif cls._start is not None:  # the collector runs one collection at a time, holding the GIL
            g = min(info["generation"], 2)
            cls.seconds[g] += time.perf_counter() - cls._start
            cls.collections[g] += 1
            cls._start = None

    def collect(self):
        """Prometheus collector: eaglet:gc_pause_seconds_total{generation}."""
        fam = CounterMetricFamily("eaglet:gc_pause_seconds", "Time in Python's cyclic garbage collector (every "
                                  "thread stops), by generation", labels=["generation"])
        for g, t in enumerate(self.seconds):
            fam.add_metric([str(g)], t)
        yield fam


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)  # process_resident_memory_bytes and friends, as vLLM exports
        GCPauses.install()
        r.register(GCPauses())
        labels = ["model_name"]
        self.request_success = Counter("eaglet:request_success", "Requests finished, by reason (stop, length)",
                                       labels + ["finished_reason"], registry=r)
        self.request_aborted = Counter("eaglet:request_aborted", "Requests cancelled by a client disconnect",
                                       labels, registry=r)
        self.request_failed = Counter("eaglet:request_failed", "Requests failed by an internal error",
                                      labels, registry=r)
        self.request_rejected = Counter("eaglet:request_rejected", "Requests refused: the waiting queue was "
                                        "full or the engine not running", labels, registry=r)
        self.prompt_tokens = Counter("eaglet:prompt_tokens", "Prefilled prompt tokens", labels, registry=r)
        self.generation_tokens = Counter("eaglet:generation_tokens", "Generated tokens", labels, registry=r)
        self.ttft = Histogram("eaglet:time_to_first_token_seconds", "Arrival to first token", labels,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("eaglet:inter_token_latency_seconds", "Time between a request's consecutive engine "
                             "outputs (one speculative step may bring several tokens)", labels,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("eaglet:request_time_per_output_token_seconds", "(last - first token time) / "
                              "(output tokens - 1), per request", labels, buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("eaglet:e2e_request_latency_seconds", "Arrival to last token", labels,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.running = Gauge("eaglet:num_requests_running", "Requests in a batch row", labels, registry=r)
        self.waiting = Gauge("eaglet:num_requests_waiting", "Requests in the waiting queue", labels, registry=r)
        self.kv_usage = Gauge("eaglet:kv_cache_usage_perc", "Committed KV cache tokens / capacity (0..1)",
                              labels, registry=r)
        self.kv_free = Gauge("eaglet:kv_cache_free_tokens", "KV cache token slots not holding a committed token",
                             labels, registry=r)
        self.kv_total = Gauge("eaglet:kv_cache_total_tokens", "KV cache token slots: rows x max model length",
                              labels, registry=r)
        self.drafts = Counter("eaglet:spec_decode_num_drafts", "Speculative verify steps", labels, registry=r)
        self.draft_tokens = Counter("eaglet:spec_decode_num_draft_tokens", "Drafted tokens verified",
                                    labels, registry=r)
        self.accepted_tokens = Counter("eaglet:spec_decode_num_accepted_tokens", "Drafted tokens accepted",
                                       labels, registry=r)
        self.accepted_per_pos = Counter("eaglet:spec_decode_num_accepted_tokens_per_pos",
                                        "Drafted tokens accepted at each draft position (0-based)",
                                        labels + ["position"], registry=r)
        self.spec_speculating = Gauge("eaglet:spec_policy_speculating", "1 while the current batch speculates, "
                                      "0 while it decodes plain (the speculation policy's choice when it started)",
                                      labels, registry=r)
        self.spec_setting = Gauge("eaglet:spec_policy_setting", "1 for the current batch's setting (chain:S, "
                                  "tree:S,K,N or plain), 0 for settings chosen before", labels + ["setting"],
                                  registry=r)
        self.spec_batch = Gauge("eaglet:spec_policy_batch_size", "Requests the current batch started with: what the "
                                "speculation policy chose by", labels, registry=r)
        self.engine_seconds = Counter("eaglet:engine_seconds", "The engine thread's wall time by part: idle, admit, "
                                      "step, output, other; device_wait: blocked on the device within admit and step",
                                      labels + ["part"], registry=r)
        self.engine_steps = Counter("eaglet:engine_steps", "Decoding steps of the running batch", labels, registry=r)
        self.engine_admissions = Counter("eaglet:engine_admissions", "Prefills of waiting requests into free rows "
                                         "(each admits one or more)", labels, registry=r)
        self.graphs = Gauge("eaglet:cuda_graphs_captured", "CUDA graphs the engine has captured (warm-up and "
                            "since: a capture while serving waits for the device)", labels, registry=r)
        self.name = model_name
        self.settings: set[str] = set()  # spec_setting labels shown so far
        for m in (self.request_aborted, self.request_failed, self.request_rejected, self.prompt_tokens,
                  self.generation_tokens, self.ttft, self.itl, self.tpot, self.e2e, self.running, self.waiting,
                  self.kv_usage, self.kv_free, self.kv_total, self.drafts, self.draft_tokens, self.accepted_tokens,
                  self.spec_speculating, self.spec_batch, self.graphs):
            m.labels(model_name)  # exported from the start, at 0
        for reason in ("stop", "length"):
            self.request_success.labels(model_name, reason)
        # the children updated every engine step or output (`step`, `gap`), looked up once
        self._generated, self._itl = self.generation_tokens.labels(model_name), self.itl.labels(model_name)
        self._drafts, self._draft_tokens = self.drafts.labels(model_name), self.draft_tokens.labels(model_name)
        self._accepted, self._per_pos = self.accepted_tokens.labels(model_name), {}
        self._engine = {part: self.engine_seconds.labels(model_name, part) for part in ENGINE_PARTS}
        self._engine_steps = self.engine_steps.labels(model_name)
        self._engine_admissions = self.engine_admissions.labels(model_name)

    def engine(self, seconds: dict[str, float], steps: int, admissions: int) -> None:
        """The engine's time by part (ENGINE_PARTS), decoding steps and admissions since the last call."""
        for part, t in seconds.items():
            if t:
                self._engine[part].inc(t)
        if steps:
            self._engine_steps.inc(steps)
        if admissions:
            self._engine_admissions.inc(admissions)

    def gap(self, seconds: float) -> None:
        """Time between two outputs of one request."""
        self._itl.observe(seconds)

    def step(self, tokens: int) -> None:
        """An engine step's generated tokens over all its rows: one update."""
        self._generated.inc(tokens)

    def drafted(self, d: SpecMetrics) -> None:
        """The draft counters of the steps since the last call, over all their rows."""
        if d.drafts:
            self._drafts.inc(d.drafts)
            self._draft_tokens.inc(d.draft_tokens)
            self._accepted.inc(d.accepted_tokens)
            for pos, n in enumerate(d.accepted_per_pos):
                child = self._per_pos.get(pos)
                if child is None:
                    child = self._per_pos[pos] = self.accepted_per_pos.labels(self.name, str(pos))
                child.inc(n)

    def policy(self, setting: str | None, n: int) -> None:
        """A batch of `n` requests started with `setting` (None: plain)."""
        name = setting or "plain"
        self.settings.add(name)
        for s in self.settings:
            self.spec_setting.labels(self.name, s).set(1 if s == name else 0)
        self.spec_speculating.labels(self.name).set(0 if setting is None else 1)
        self.spec_batch.labels(self.name).set(n)

    def kv(self, used: int, total: int) -> None:
        self.kv_usage.labels(self.name).set(used / total if total else 0.0)
        self.kv_free.labels(self.name).set(total - used)
        self.kv_total.labels(self.name).set(total)

    def render(self) -> bytes:
        return generate_latest(self.registry)
