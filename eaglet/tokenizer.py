"""Tokenizer and chat template from the model itself (tokenizer.json / tokenizer_config.json, as
saved from a HF repo or converted from GGUF metadata; tiktoken ranks: tiktoken_dir.py), through
transformers; plus TextStream, the
incremental detokenizer that streams text and applies stop strings."""
from __future__ import annotations

from pathlib import Path

from .errors import InvalidInput, ModelLoadError


class Tokenizer:
    def __init__(self, hf_tokenizer, eos_ids: set[int]):
        self.hf = hf_tokenizer
        self.eos_ids = frozenset(eos_ids)
        # a fast tokenizer's Rust core encodes alike without transformers' per-call Python (a server
        # tokenizes every request on its event loop); not where tokenizer.json sets truncation or
        # padding, which transformers turns off for each call
        core = getattr(hf_tokenizer, "backend_tokenizer", None)
        self.encoder = core if core is not None and core.truncation is None and core.padding is None else None
        # and decodes alike (the server's engine detokenizes every row's new tokens each step) where
        # transformers adds nothing after the core's decode: no clean-up of tokenization spaces, or
        # one it skips (transformers 5 ignores the flag for BPE tokenizers: SmolLM2's config sets it)
        cleans = getattr(hf_tokenizer, "clean_up_tokenization_spaces", False)
        self.decoder = core if core is not None and (not cleans or decodes_alike(hf_tokenizer, core)) else None

    def ids(self, text: str, special: bool) -> list[int]:
        """Token ids of `text`, with the special tokens the tokenizer adds or without."""
        if self.encoder is not None:
            return self.encoder.encode(text, add_special_tokens=special).ids
        return list(self.hf(text, add_special_tokens=special).input_ids)

    @staticmethod
    def from_dir(path: Path, config) -> "Tokenizer | None":
        """The tokenizer saved in a model directory, or None when the directory has none."""
        from . import tiktoken_dir

        if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                                                  "tiktoken.model")):
            return None
        from transformers import AutoTokenizer

        try:  # tiktoken ranks (Kimi) without the repository's own tokenizer code; else transformers'
            hf = tiktoken_dir.fast_tokenizer(path) if tiktoken_dir.is_tiktoken_dir(path) else \
                AutoTokenizer.from_pretrained(str(path))
        except ModelLoadError:
            raise
        except Exception as e:  # transformers raises many types for broken tokenizer files
            raise ModelLoadError(f"{path}: cannot load the tokenizer ({e})") from None
        eos = set(config.eos_token_ids)
        if hf.eos_token_id is not None:
            eos.add(hf.eos_token_id)
        return Tokenizer(hf, eos)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        return self.ids(text, True)

    def apply_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of `messages` rendered with the model's chat template, ready for the reply."""
        if not getattr(self.hf, "chat_template", None):
            raise InvalidInput("this model has no chat template; pass a plain prompt without --chat")
        text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.ids(text, False)

    def user_prefix(self, opening: str = "") -> list[int]:
        """Token ids of the chat template up to where a user's message begins (a default system
        prompt and the user header included), then `opening`, the turn's first words: continued by
        the model, a user turn it writes."""
        if not getattr(self.hf, "chat_template", None):
            raise InvalidInput("this model has no chat template")
        mark = "\x00eaglet-user\x00"
        text = self.hf.apply_chat_template([{"role": "user", "content": mark}], tokenize=False)
        if mark not in text:
            raise InvalidInput("the chat template does not show where a user message begins")
        return self.ids(text[:text.index(mark)] + opening, False)

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        if self.decoder is not None:
            return self.decoder.decode(ids, skip_special_tokens=skip_special)
        return self.hf.decode(ids, skip_special_tokens=skip_special)


CLEAN_UP_PROBE = "a . b , c ? d ! e ' f n't g 'm h 's i 've j 're k"  # what the clean-up rewrites


def decodes_alike(hf_tokenizer, core) -> bool:
    """Whether transformers' decode gives the tokenizer core's text where its clean-up would act."""
    ids = core.encode(CLEAN_UP_PROBE, add_special_tokens=False).ids
    return hf_tokenizer.decode(ids, skip_special_tokens=True) == core.decode(ids, skip_special_tokens=True)


class TextStream:
    """Turns a growing list of token ids into text deltas. Holds back an incomplete UTF-8 character
    and any tail that could begin a stop string; stops at the first stop string (not included).

    Decoding is incremental (a window of a few tokens per push, as TGI and vLLM do it): the new
    text is decode(window + new tokens) minus decode(window), so the cost per token stays constant
    however long the output grows, and words that depend on the token before them decode right."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()):
        self.tok, self.stop = tokenizer, tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.prefix_off = self.read_off = 0  # ids[prefix_off:read_off] is the decoding window
        self.full = ""  # text of ids[:read_off]
        self.text = ""  # everything emitted so far
        self.stopped = False

    def _decoded(self) -> str | None:
        """Text of every id so far, or None while the newest ids end inside a UTF-8 character."""
        prefix = self.tok.decode(self.ids[self.prefix_off:self.read_off])
        new = self.tok.decode(self.ids[self.prefix_off:])
        if new.endswith("\ufffd"):
            return None
        return self.full + new[len(prefix):]

    def push(self, token: int) -> str:
        """Add one token; return the text that became final."""
        self.ids.append(token)
        full = self._decoded()
        if full is None:  # a multi-byte character split across tokens
            return ""
        self.full, self.prefix_off, self.read_off = full, self.read_off, len(self.ids)
        for s in self.stop:
            at = full.find(s, max(0, len(self.text) - len(s)))
            if at >= 0:
                self.stopped = True
                return self._emit(full[:at])
        hold = max((k for s in self.stop for k in range(1, len(s)) if full.endswith(s[:k])), default=0)
        return self._emit(full[: len(full) - hold])

    def extend(self, tokens: list[int]) -> str:
        """Add several tokens (a speculative step's); return the text that became final: what
        pushing them one at a time returns, joined, for one decode of the window instead of one per
        token. With stop strings each token is pushed alone (the one that completes a stop ends
        the text)."""
        if self.stop or len(tokens) == 1:
            return "".join(self.push(t) for t in tokens)
        self.ids.extend(tokens)
        full = self._decoded()
        if full is None:  # ends inside a multi-byte character: one at a time gives out the text before it
            del self.ids[-len(tokens):]
            return "".join(self.push(t) for t in tokens)
        self.full, self.prefix_off, self.read_off = full, self.read_off, len(self.ids)
        return self._emit(full)

    def flush(self) -> str:
        """At the end of generation: release any held-back text."""
        if self.stopped:
            return ""
        rest = self.tok.decode(self.ids[self.prefix_off:])[len(self.tok.decode(self.ids[self.prefix_off:self.read_off])):]
        return self._emit(self.full + (rest if self.read_off < len(self.ids) else ""))

    def _emit(self, upto: str) -> str:
        delta = upto[len(self.text):] if upto.startswith(self.text) else ""
        self.text += delta
        return delta
