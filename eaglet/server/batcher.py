"""The decoding core of the server: a fixed number of rows (slots) of one decoder; each request
brings its own sampling settings and random stream (a row's, on the device). Requests join free rows (`add`: their prompts are prefilled while the
other rows keep their state), every `step` advances all running rows at once (plain: one token,
speculative: each row its own accepted count), and a finished or cancelled request leaves at once
(`release` frees its row's cache). Per row, stopping is what Generator.stream does: EOS, stop
strings, the token budget. On the GPU a step is launched before the previous one is collected
(the decoder's lookahead), so the engine thread's work on one step's tokens overlaps the next.

It runs on the engine thread only (engine.py owns the thread, the queue and the HTTP side).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from ..generate import Generator, SeqState
from ..runtime.decoder import Decoder, Step
from ..spec.metrics import SpecMetrics
from ..tokenizer import Tokenizer

log = logging.getLogger("eaglet.server")


class Sequence(SeqState):
    """One request in one row: its stopping state (SeqState) and, once it finishes in a speculating
    batch, its draft counters."""

    def __init__(self, request, tokenizer: Tokenizer, eos: frozenset[int]):
        super().__init__(tokenizer, request.stop, frozenset() if request.ignore_eos else eos, request.max_tokens)
        self.request = request
        self.spec = SpecMetrics()  # this request's draft counters (set when it finishes)


@dataclass
class Output:
    """What one row produced in one add/step."""
    row: int
    seq: Sequence
    text: str
    tokens: int
    error: Exception | None = None  # an internal failure of this row alone

    @property
    def finished(self) -> bool:
        return self.error is not None or self.seq.finish_reason is not None


class Batcher:
    def __init__(self, dec: Decoder, step: Step, tokenizer: Tokenizer, eos: frozenset[int]):
        """A batch over all rows of `dec` (freed first), running `step` (its plain step or a
        speculative one on its rows)."""
        dec.free_all()
        dec.use(step)
        self.dec, self.tokenizer, self.eos = dec, tokenizer, eos
        self.dec.take_device_wait()  # the engine's count starts with this batch (not a warm-up's)
        self.spec = None if step is dec.plain else step  # its draft counters
        self.speculative = self.spec is not None
        self.rows: list[Sequence | None] = [None] * dec.batch

    @staticmethod
    def of(generator: Generator, slots: int, max_len: int) -> "Batcher":
        """A batch over the generator's decoder, running the generator's step."""
        dec = generator.decoder(slots, max_len)
        return Batcher(dec, dec.current, generator.tokenizer, generator.eos_ids())

    @property
    def free_rows(self) -> list[int]:
        return [i for i, s in enumerate(self.rows) if s is None]

    @property
    def running(self) -> int:
        return sum(s is not None for s in self.rows)

    @property
    def kv_used(self) -> int:
        """Committed cache tokens over all rows."""
        return int(self.dec.cache.host_lens.sum())

    def add(self, requests: list) -> list[Output]:
        """Prefill `requests` into free rows (at most len(free_rows)); their first tokens."""
        rows = self.free_rows[: len(requests)]
        for r, req in zip(rows, requests):
            self.rows[r] = Sequence(req, self.tokenizer, self.eos)
            req.row = r
        try:
            # a request's stream is its seed's (as the seed's first prompt in Generator.generate);
            # beside steps in flight the first tokens come with the next step's, not waiting for
            # the device (Decoder.admit)
            new = self.dec.admit(rows, [req.prompt for req in requests], [req.sampling for req in requests],
                                 [req.sampling.stream() for req in requests], [not req.ignore_eos for req in requests],
                                 wait=not self.dec.in_flight)
        except Exception:
            self.release_rows(rows)
            raise
        if new is None:  # the device may emit all but the first token, which the prefill drew
            self.dec.set_rows(rows, [self.rows[r].remaining - 1 for r in rows])
            return []
        out = self._emit(dict(zip(rows, new)))
        self.dec.set_rows(rows, [self.rows[r].remaining for r in rows])
        return out

    def step(self, trip: int | None = None) -> list[Output]:
        """Launch a trip of decoder steps for every running row (Decoder.advance; `trip` steps, or
        the decoder's own count), and hand out the tokens of the oldest trip in flight (with
        lookahead, the trip launched before this one)."""
        new = self.dec.advance([s.remaining if s is not None else 0 for s in self.rows], trip) or []
        return self._emit({r: toks for r, toks in enumerate(new) if toks and self.rows[r] is not None})

    def use(self, step: Step) -> list[Output]:
        """Run `step` on the running rows, and those that join, from now on, on the same cache: plain
        (a speculating batch has no way back from it until it ends) or another speculation setting
        over the same drafter state; the tokens of the steps that were in flight."""
        if step is not self.dec.plain:
            self.spec = step  # the same draft counters as the step before it (Engine.step)
        merged: dict[int, list[int]] = {}
        for new in self.dec.use(step):
            for r, toks in enumerate(new):
                if toks and self.rows[r] is not None:
                    merged.setdefault(r, []).extend(toks)
        return self._emit(merged)

    def release(self, row: int) -> None:
        self.release_rows([row])

    def release_rows(self, rows: list[int]) -> None:
        """Free these rows: one release of the decoder for all of them (each is a few copies to the
        device, which on the GPU cost the engine thread more than the rows' bookkeeping)."""
        rows = [r for r in dict.fromkeys(rows) if self.rows[r] is not None]
        if rows:
            for r in rows:
                self.rows[r].request.row = None
                self.rows[r] = None
            self.dec.release(rows)
            if not self.running:
                self.dec.drain()  # an idle batch keeps no step in flight

    def _emit(self, new: dict[int, list[int]]) -> list[Output]:
        out = []
        for r, toks in new.items():
            seq = self.rows[r]
            try:
                text, n = seq.push_many(toks)
                if seq.finish_reason and self.speculative:
                    seq.spec = self.spec.counters.of(r)
                out.append(Output(r, seq, text, n))
            except Exception as e:  # fails this row's request only
                log.exception("request %s failed in row %d", seq.request.id, r)
                out.append(Output(r, seq, "", 0, error=e))
        return out
