"""Generation for a batch of prompts: prefill, then plain decoding one token per step, streaming
each token (and its text) as it is produced. Stops per sequence on EOS, stop strings or the
token budget. Speculative decoding plugs into the same loop (spec/) by producing several tokens
per step; everything about stopping and streaming stays here.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from .errors import InvalidInput
from .kvcache import KVCache
from .models.attention import AttnMeta
from .models.llama import CausalLM
from .models.prefill import prefill
from .sampling import SamplingParams, sample
from .spec.loop import SpecDecoder
from .spec.metrics import SpecMetrics
from .spec.speculator import Speculator
from .tokenizer import TextStream, Tokenizer


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise InvalidInput(f"max_new_tokens must be a positive integer, got {self.max_new_tokens}")


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


class PlainDecoder:
    """One target forward per token. Holds the batch's KV cache for one generate call."""

    def __init__(self, model: CausalLM, batch: int, max_len: int, sampling: SamplingParams):
        p = next(model.parameters())
        self.model, self.sampling = model, sampling
        self.cache = KVCache.for_model(model.config, batch, max_len, p.dtype, p.device)
        self.gen = sampling.generator(p.device)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, n_new: list[int] | int) -> torch.Tensor:
        """Run new tokens (B, T) and commit n_new[b] of them; returns hidden (B, T, H)."""
        meta = AttnMeta.build(self.cache.lens, positions, self.cache.kv_len(ids.shape[1]),
                              sliding_window=self.model.config.sliding_window)
        hidden, _ = self.model(ids, positions, self.cache, meta)
        self.cache.advance(n_new)
        return hidden

    def prefill(self, prompts: list[list[int]]) -> list[list[int]]:
        """Run the prompts; return the first generated token of each."""
        h, _ = prefill(self.model, self.cache, prompts)  # (B, H)
        self.last = sample(self.model.logits(h).float(), self.sampling, self.gen)  # (B,)
        return [[t] for t in self.last.tolist()]  # sync: tokens must reach the host to stream and stop

    def step(self, limit: list[int]) -> list[list[int]]:
        """Feed each sequence's last token; return the next token of each. (One token never
        exceeds a row's budget; finished rows keep stepping, which max_len allows for.)"""
        positions = self.cache.lens[:, None].clone()  # (B, 1)
        hidden = self.forward(self.last[:, None], positions, 1)
        self.last = sample(self.model.logits(hidden[:, -1]).float(), self.sampling, self.gen)  # (B,)
        return [[t] for t in self.last.tolist()]  # sync: tokens must reach the host to stream and stop


class Generator:
    """Plain or speculative generation (with a Speculator) for a batch of prompts."""

    def __init__(self, model: CausalLM, tokenizer: Tokenizer | None, speculator: Speculator | None = None,
                 trace: list | None = None):
        self.model, self.tokenizer, self.speculator = model, tokenizer, speculator
        self.trace = trace  # handed to SpecDecoder: the profiler records draft trees there
        self.context = model.config.max_position
        self.last_metrics: list[SpecMetrics] | None = None  # per sequence, of the last call

    def decoder(self, batch: int, max_len: int, sampling: SamplingParams):
        if self.speculator is None:
            return PlainDecoder(self.model, batch, max_len, sampling)
        dev = next(self.model.parameters()).device
        gen = sampling.generator(dev)
        drafter = self.speculator.make(self.model, batch, max_len, sampling, gen)
        return SpecDecoder(self.model, drafter, self.speculator.spec, batch, max_len, sampling, gen, self.trace)

    def check_prompts(self, prompts: list[list[int]]) -> None:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise InvalidInput("empty prompt")
        for p in prompts:
            if len(p) >= self.context:
                raise InvalidInput(f"prompt is {len(p)} tokens but the model's context is {self.context} "
                                   "(at least one token must remain to generate)")

    @torch.inference_mode()
    def stream(self, prompts: list[list[int]], gen: GenerationConfig) -> Iterator[TokenEvent]:
        """Yield one TokenEvent per generated token, in the order produced."""
        self.check_prompts(prompts)
        budget = [min(gen.max_new_tokens, self.context - len(p)) for p in prompts]
        # a finished row keeps stepping (and writing K/V) until the whole batch is done, so every
        # row needs room for the longest budget, not just its own
        max_len = max(map(len, prompts)) + max(budget)
        dec = self.decoder(len(prompts), max_len, gen.sampling)
        self.last_metrics = getattr(dec, "metrics", None)
        streams = [TextStream(self.tokenizer, gen.stop) if self.tokenizer else None for _ in prompts]
        counts = [0] * len(prompts)
        done = [False] * len(prompts)
        eos = frozenset() if gen.ignore_eos else (
            frozenset(self.model.config.eos_token_ids) | (self.tokenizer.eos_ids if self.tokenizer else frozenset()))

        new = dec.prefill(prompts)
        while True:
            for i, toks in enumerate(new):
                for tok in toks:
                    if done[i]:
                        break
                    counts[i] += 1
                    text = streams[i].push(tok) if streams[i] else ""
                    reason = ("stop" if tok in eos or (streams[i] and streams[i].stopped)
                              else "length" if counts[i] >= budget[i] else None)
                    if reason:
                        done[i] = True
                        if streams[i]:
                            text += streams[i].flush()
                    yield TokenEvent(i, tok, text, reason)
            if all(done):
                return
            new = dec.step([0 if d else b - c for d, b, c in zip(done, budget, counts)])

    def generate(self, prompts: list[list[int]], gen: GenerationConfig,
                 on_event: Callable[[TokenEvent], None] | None = None) -> list[Completion]:
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
        metrics = self.last_metrics or [None] * len(prompts)
        return [Completion(len(p), t, x, r, m) for p, t, x, r, m in zip(prompts, tokens, texts, reasons, metrics)]
