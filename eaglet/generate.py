"""Generation for a batch of prompts: prefill, then decoding steps, streaming each token (and its
text) as it is produced. Stops per sequence on EOS, stop strings or the token budget. The decoder
(runtime/decoder.py) runs the steps: plain ones, one token a row, or speculative ones (spec/loop.py),
several; everything about stopping and streaming stays here.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from .errors import InvalidInput
from .models.llama import CausalLM
from .runtime.decoder import Decoder
from .runtime.observer import StepObserver
from .sampling import SamplingParams
from .spec.loop import SpecStep, spec_decoder
from .spec.metrics import SpecMetrics
from .spec.speculator import Speculator
from .tokenizer import TextStream, Tokenizer


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 256
    # one SamplingParams for every prompt (the i-th prompt draws from the seed's i-th stream), or a
    # tuple of one per prompt (each draws from its own seed's stream, as a request sent alone)
    sampling: SamplingParams | tuple[SamplingParams, ...] = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise InvalidInput(f"max_new_tokens must be a positive integer, got {self.max_new_tokens}")

    def rows(self, n: int) -> tuple[list[SamplingParams], list[int]]:
        """The sampling settings and random streams of n prompts."""
        if isinstance(self.sampling, SamplingParams):
            return [self.sampling] * n, [self.sampling.stream(i) for i in range(n)]
        if len(self.sampling) != n:
            raise InvalidInput(f"{len(self.sampling)} sampling settings for {n} prompts")
        return list(self.sampling), [p.stream() for p in self.sampling]


@dataclass
class TokenEvent:
    seq: int  # index of the prompt in the batch
    token: int
    text: str  # text that became final with this token ('' when held back)
    finish_reason: str | None = None  # 'stop' | 'length' on the sequence's last event


@dataclass
class Completion:
    prompt_tokens: int
    tokens: list[int]
    text: str
    finish_reason: str
    spec: SpecMetrics | None = None  # speculation metrics of this sequence (None for plain decoding)


class SeqState:
    """One sequence's stopping and text: EOS, stop strings and the token budget (shared by
    Generator.stream and the server's batcher)."""

    def __init__(self, tokenizer: Tokenizer | None, stop: tuple[str, ...], eos: frozenset[int], budget: int):
        self.stream = TextStream(tokenizer, stop) if tokenizer else None
        self.eos, self.budget = eos, budget
        self.count = 0
        self.finish_reason: str | None = None  # 'stop' | 'length' once finished

    @property
    def remaining(self) -> int:
        return 0 if self.finish_reason else self.budget - self.count

    def push(self, tok: int) -> str:
        """Take one token (callers stop pushing once finished); returns the text that became final."""
        self.count += 1
        text = self.stream.push(tok) if self.stream else ""
        return text + self._settle(tok)

    def _settle(self, last: int) -> str:
        """After taking tokens up to `last`: finish on EOS, a stop string or the budget, and release
        any held-back text then."""
        if last in self.eos or (self.stream and self.stream.stopped):
            self.finish_reason = "stop"
        elif self.count >= self.budget:
            self.finish_reason = "length"
        return self.stream.flush() if self.finish_reason and self.stream else ""

    def push_each(self, tokens: list[int]) -> tuple[str, int]:
        """`push` each token until the sequence finishes: the text that became final, tokens taken."""
        text, n = "", 0
        for tok in tokens:
            if self.finish_reason:
                break
            text += self.push(tok)
            n += 1
        return text, n

    def push_many(self, tokens: list[int]) -> tuple[str, int]:
        """Take a step's tokens up to the one that finishes the sequence (none once finished): the
        text that became final and how many tokens counted, as push_each gives them, for one decode
        of the window."""
        if self.finish_reason or not tokens:
            return "", 0
        if self.stream and (self.stream.stop or len(tokens) == 1):  # a stop string ends at its token
            return self.push_each(tokens)
        n = next((i + 1 for i, tok in enumerate(tokens) if tok in self.eos), len(tokens))
        n = min(n, self.budget - self.count)
        self.count += n
        text = self.stream.extend(tokens[:n]) if self.stream else ""
        return text + self._settle(tokens[n - 1]), n


def room(n: int) -> int:
    """Cache slots per row for a call needing `n`: rounded up (to a power of two up to 128, then to
    a multiple of 128) so that later calls fit too, without making a short call's cache, whose
    zeroing and attention cost scale with it, many times what it needs."""
    return 1 << max(n - 1, 0).bit_length() if n <= 128 else -(-n // 128) * 128


class Generator:
    """Plain or speculative generation (with a Speculator) for a batch of prompts.

    `graphs` turns CUDA graphs on (GPU only; `--eager` turns them off). The decoder of the last
    call is kept and reused while the batch size stays the same and its cache
    is long enough, so its captured graphs serve the next calls too. `observer` (a PhaseTimer, the
    profiler's trace) watches the steps of the decoders made from then on (`observe`)."""

    def __init__(self, model: CausalLM, tokenizer: Tokenizer | None, speculator: Speculator | None = None,
                 graphs: bool = True, lookahead: bool | None = None, observer: StepObserver | None = None):
        self.model, self.tokenizer, self.speculator = model, tokenizer, speculator
        self.graphs, self.lookahead, self.observer = graphs, lookahead, observer
        self.context = model.config.max_position
        self._kept = None  # (batch, max_len, decoder, its speculative step or None) of the last call

    def decoder(self, batch: int, max_len: int) -> Decoder:
        """A decoder with `batch` rows and room for `max_len` tokens each, all rows free, running
        this generator's step (plain, or its speculator's). Each row's sampling settings come with
        its prompt (Decoder.admit), so one decoder serves every setting."""
        kept = self._kept
        if kept and kept[0] == batch and kept[1] >= max_len:
            dec, spec = kept[2], kept[3]
            dec.free_all()
            dec.use(spec or dec.plain)
            return dec
        max_len = min(room(max_len), self.context + 128)
        self._kept = None  # free the old caches first
        if self.speculator is None:
            dec = Decoder(self.model, batch, max_len, self.graphs, self.lookahead, self.observer, self.eos_ids())
        else:
            drafter = self.speculator.make(self.model, batch, max_len)
            dec = spec_decoder(self.model, drafter, self.speculator.spec, batch, max_len, self.graphs, self.lookahead,
                               self.observer, self.eos_ids())
        self._kept = (batch, max_len, dec, dec.current if self.speculator else None)
        return dec

    def decoder_in_use(self) -> Decoder | None:
        """The decoder of the last call (kept for the next ones), if any."""
        return self._kept[2] if self._kept else None

    def fresh(self) -> None:
        """Drop the kept decoder (its caches and graphs): the next call makes a new one."""
        self._kept = None

    def observe(self, observer: StepObserver | None) -> None:
        """Watch the steps of the next calls with `observer` (None: nothing watches), on a fresh
        decoder (its graphs are captured again)."""
        self.observer = observer
        self.fresh()

    def check_prompts(self, prompts: list[list[int]]) -> None:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise InvalidInput("empty prompt")
        for p in prompts:
            if len(p) >= self.context:
                raise InvalidInput(f"prompt is {len(p)} tokens but the model's context is {self.context} "
                                   "(at least one token must remain to generate)")

    def stream(self, prompts: list[list[int]], gen: GenerationConfig) -> Iterator[TokenEvent]:
        """Yield one TokenEvent per generated token, in the order produced."""
        for seqs, new in self._steps(prompts, gen, self.tokenizer):
            yield from self._push(seqs, new)

    @torch.inference_mode()
    def _steps(self, prompts: list[list[int]], gen: GenerationConfig,
               tokenizer: Tokenizer | None) -> Iterator[tuple[list[SeqState], list[list[int]]]]:
        """The decode loop: every sequence's state and each row's new tokens, after the prefill and
        after every step; the caller pushes them before the next step (it decides who stopped)."""
        self.check_prompts(prompts)
        budget = [min(gen.max_new_tokens, self.context - len(p)) for p in prompts]
        max_len = max(len(p) + b for p, b in zip(prompts, budget))  # a finished row stops moving
        dec = self.decoder(len(prompts), max_len)  # its draft counters are this call's (last_metrics)
        eos = frozenset() if gen.ignore_eos else self.eos_ids()
        seqs = [SeqState(tokenizer, gen.stop, eos, b) for b in budget]
        rows = list(range(len(prompts)))
        yield seqs, dec.admit(rows, prompts, *gen.rows(len(prompts)), [not gen.ignore_eos] * len(prompts))
        dec.set_rows(rows, [s.remaining for s in seqs])
        while True:
            stopped = [i for i, s in enumerate(seqs) if s.finish_reason and dec.live[i]]
            dec.set_rows(stopped, [0] * len(stopped))  # with lookahead they ran one step past their end
            new = dec.advance([s.remaining for s in seqs])
            if new is None:
                return
            yield seqs, new

    @staticmethod
    def _push(seqs: list[SeqState], new: list[list[int]]) -> Iterator[TokenEvent]:
        for i, toks in enumerate(new):
            for tok in toks:
                if seqs[i].finish_reason:
                    break
                text = seqs[i].push(tok)
                yield TokenEvent(i, tok, text, seqs[i].finish_reason)

    @property
    def last_metrics(self) -> list[SpecMetrics] | None:
        """Per sequence of the last call: its draft counters (None for plain decoding)."""
        spec: SpecStep | None = self._kept[3] if self._kept else None
        return spec.metrics if spec is not None else None

    def eos_ids(self) -> frozenset[int]:
        return frozenset(self.model.config.eos_token_ids) | (self.tokenizer.eos_ids if self.tokenizer else frozenset())

    def generate(self, prompts: list[list[int]], gen: GenerationConfig,
                 on_event: Callable[[TokenEvent], None] | None = None, text: bool = True) -> list[Completion]:
        """text=False: the tokens alone (Completion.text stays empty), without detokenizing token by
        token; for large batches whose text nobody reads (data regeneration, eval-draft), where that
        host work would cost more than a decode step."""
        if text and (self.tokenizer is not None or on_event or gen.stop):  # without a tokenizer, no text to make
            tokens, texts, reasons = self._with_text(prompts, gen, on_event)
        elif on_event or gen.stop:
            raise InvalidInput("generate(text=False) streams no events and cannot stop on stop strings")
        else:
            tokens, texts, reasons = self._tokens_only(prompts, gen)
        metrics = self.last_metrics or [None] * len(prompts)
        return [Completion(len(p), t, x, r, m) for p, t, x, r, m in zip(prompts, tokens, texts, reasons, metrics)]

    def _with_text(self, prompts, gen, on_event):
        tokens: list[list[int]] = [[] for _ in prompts]
        texts = [""] * len(prompts)
        reasons = [""] * len(prompts)
        for ev in self.stream(prompts, gen):
            tokens[ev.seq].append(ev.token)
            texts[ev.seq] += ev.text
            if ev.finish_reason:
                reasons[ev.seq] = ev.finish_reason
            if on_event:
                on_event(ev)
        return tokens, texts, reasons

    def _tokens_only(self, prompts, gen):
        tokens: list[list[int]] = [[] for _ in prompts]
        seqs: list[SeqState] = []
        for seqs, new in self._steps(prompts, gen, None):
            for seq, out, toks in zip(seqs, tokens, new):
                if toks and not seq.finish_reason:
                    out += toks[:seq.push_many(toks)[1]]
        return tokens, [""] * len(prompts), [s.finish_reason or "" for s in seqs]
