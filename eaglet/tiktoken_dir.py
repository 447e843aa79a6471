"""Tokenizers shipped as tiktoken BPE ranks: Kimi-K2's `tiktoken.model` beside a
`tokenizer_config.json`, with Python code of their own that eaglet does not run (they load in
transformers only with trust_remote_code). The ranks are read with the tiktoken package and turned
into a fast tokenizer (transformers' TikTokenConverter: byte-level BPE with the model's
pre-tokenization pattern); its special tokens, their ids, the EOS token and the chat template come
from tokenizer_config.json (or chat_template.jinja).
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from .errors import ModelLoadError

# Kimi-K2's pre-tokenization (its tokenization_kimi.py `pat_str`): a run of Han characters on its
# own, letter runs with Han subtracted, digits in groups of up to three, as o200k otherwise
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])


def is_tiktoken_dir(path: Path) -> bool:
    return (path / "tiktoken.model").exists() and not (path / "tokenizer.json").exists()


def fast_tokenizer(path: Path):
    """A transformers fast tokenizer for the tiktoken.model in `path`."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    if importlib.util.find_spec("tiktoken") is None:  # the converter reads the ranks with it
        raise ModelLoadError(f"{path}: its tokenizer is tiktoken.model, which needs the tiktoken package "
                             f"(pip install tiktoken)")
    cfg_file = path / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
    ranks = sum(1 for line in (path / "tiktoken.model").read_bytes().splitlines() if line.strip())
    special = {int(i): t["content"] for i, t in (cfg.get("added_tokens_decoder") or {}).items()}
    if special and min(special) < ranks:
        raise ModelLoadError(f"{cfg_file}: special token id {min(special)} falls inside the {ranks} BPE ranks")
    # special tokens take the ids after the ranks, in order: the gaps get placeholders so ids line up
    names = [special.get(i, f"<|reserved_token_{i}|>") for i in range(ranks, max(special, default=ranks - 1) + 1)]
    try:
        core = TikTokenConverter(vocab_file=str(path / "tiktoken.model"), pattern=KIMI_PATTERN,
                                 extra_special_tokens=names).converted()
    except Exception as e:  # a malformed ranks file
        raise ModelLoadError(f"{path / 'tiktoken.model'}: cannot read the BPE ranks ({e})") from None
    template = cfg.get("chat_template")
    if template is None and (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text()
    token = lambda key: (cfg.get(key) or {}).get("content") if isinstance(cfg.get(key), dict) else cfg.get(key)  # noqa: E731
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token=token("eos_token"), bos_token=token("bos_token"),
                                   pad_token=token("pad_token"), chat_template=template)
