"""bench/code_prompts.py: HumanEval-style prompts from source trees, as ShareGPT JSON `eaglet data` reads."""
import gzip
import importlib.util
import json
from pathlib import Path

from eaglet.datasets import HUMANEVAL_TEMPLATE, read_sharegpt

spec = importlib.util.spec_from_file_location("code_prompts", Path(__file__).parent.parent / "bench" / "code_prompts.py")
code_prompts = importlib.util.module_from_spec(spec)
spec.loader.exec_module(code_prompts)

DOC = "Return the running maximum of xs, one value per element, as a new list."

SOURCE = f'''
import os


def running_max(xs: list[int]) -> list[int]:
    """{DOC}

    >>> running_max([1, 3, 2])
    [1, 3, 3]
    """
    out = []
    return out


def _private(x):
    """{DOC}"""


def short_doc(x):
    """Too short."""


class Stack:
    def push(self, item):
        """{DOC}"""
        self.items.append(item)

    def _hidden(self):
        """{DOC}"""


def has_close_elements(numbers, threshold):
    """{DOC}"""
'''


def tree(tmp_path: Path) -> Path:
    root = tmp_path / "src"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "mod.py").write_text(SOURCE)
    (root / "pkg" / "copy.py").write_text(SOURCE)  # the same functions again: kept once
    (root / "tests").mkdir()
    (root / "tests" / "helpers.py").write_text(SOURCE.replace("running_max", "in_a_test_dir"))
    (root / "pkg" / "test_mod.py").write_text(SOURCE.replace("running_max", "in_a_test_file"))
    (root / "pkg" / "broken.py").write_text("def f(:\n")
    return root


def test_prompts_are_headers_and_docstrings_of_public_functions(tmp_path):
    prompts, per_source = code_prompts.collect([tree(tmp_path)], {"has_close_elements"})
    names = sorted(p.split("def ", 1)[1].split("(", 1)[0] for p in prompts)
    # private functions and methods, short docstrings, tests, HumanEval's entry points, duplicates: left out
    assert names == ["push", "running_max"]
    assert per_source == {"src": 2}
    rm = next(p for p in prompts if "running_max" in p)
    assert rm.startswith("def running_max(xs: list[int]) -> list[int]:\n") and rm.endswith('    """\n')
    assert ">>> running_max([1, 3, 2])" in rm and "out = []" not in rm  # cut where the docstring ends
    push = next(p for p in prompts if "push" in p)
    assert push.startswith("def push(self, item):\n")  # dedented out of its class
    assert "append" not in push


def test_writes_sharegpt_json_that_eaglet_data_reads(tmp_path):
    out, root = tmp_path / "code.json.gz", tree(tmp_path)
    assert code_prompts.main([str(out), "--root", str(root)]) == 0
    with gzip.open(out, "rt") as f:
        convs = json.load(f)
    read = read_sharegpt_gz(out, tmp_path)
    assert len(read.conversations) == len(convs) == 2 and not read.truncated
    for c in convs:
        turn = c["conversations"][0]
        assert turn["from"] == "human"
        body = turn["value"].split("```python\n", 1)[1][:-3]
        assert turn["value"] == HUMANEVAL_TEMPLATE.format(prompt=body)
    limited = tmp_path / "one.json"
    code_prompts.main([str(limited), "--root", str(root), "--limit", "1"])
    assert len(json.loads(limited.read_text())) == 1


def read_sharegpt_gz(path: Path, tmp_path: Path):
    plain = tmp_path / "plain.json"
    with gzip.open(path, "rt") as f:
        plain.write_text(f.read())
    return read_sharegpt(plain)
