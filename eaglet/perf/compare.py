"""`eaglet compare A.json B.json`: why does this run differ from that one? Lists every difference
in flags, environment (versions, GPU, driver, git SHA, NCCL_*/CUDA_* variables) and model files,
next to the change in every numeric result the two records share."""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import InvalidInput

SECTIONS = ("flags", "environment", "models")
VOLATILE = {"environment.time_utc"}  # differs between any two runs; shown last


def flatten(obj, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}{k}."))
    elif isinstance(obj, list) and obj and all(isinstance(x, (dict, list)) for x in obj):
        for i, v in enumerate(obj):
            out.update(flatten(v, f"{prefix}{i}."))
    else:
        out[prefix[:-1]] = obj
    return out


def load_record(path: str) -> dict:
    p = Path(path)
    if not p.exists():
        raise InvalidInput(f"record {path!r} does not exist")
    try:
        rec = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise InvalidInput(f"{path}: not JSON ({e})") from None
    if not isinstance(rec, dict) or "results" not in rec or "environment" not in rec:
        raise InvalidInput(f"{path}: not an eaglet record (no 'environment' and 'results')")
    return rec


def compare(a: dict, b: dict) -> dict:
    """{'differences': [(key, a, b)], 'results': [(key, a, b, relative change)]}."""
    diffs = []
    for section in SECTIONS:
        fa, fb = flatten(a.get(section, {}), f"{section}."), flatten(b.get(section, {}), f"{section}.")
        for k in sorted(set(fa) | set(fb)):
            if fa.get(k, "<absent>") != fb.get(k, "<absent>"):
                diffs.append((k, fa.get(k, "<absent>"), fb.get(k, "<absent>")))
    diffs.sort(key=lambda d: d[0] in VOLATILE)
    ra, rb = flatten(a["results"]), flatten(b["results"])
    results = []
    for k in sorted(set(ra) & set(rb)):
        x, y = ra[k], rb[k]
        if isinstance(x, (int, float)) and isinstance(y, (int, float)) and not isinstance(x, bool) and x != y:
            results.append((k, x, y, (y - x) / x if x else float("inf")))
    return {"kind": (a.get("kind"), b.get("kind")), "differences": diffs, "results": results}


def render(c: dict, name_a: str, name_b: str) -> str:
    lines = [f"A = {name_a}", f"B = {name_b}"]
    if c["kind"][0] != c["kind"][1]:
        lines.append(f"note: different kinds of record ({c['kind'][0]} vs {c['kind'][1]})")
    lines.append(f"{len(c['differences'])} differences in settings, environment and models:")
    for k, x, y in c["differences"]:
        lines.append(f"  {k}: {json.dumps(x, default=str)} -> {json.dumps(y, default=str)}")
    lines.append(f"{len(c['results'])} results changed:")
    for k, x, y, rel in c["results"]:
        lines.append(f"  {k}: {x:.4g} -> {y:.4g} ({rel:+.1%})")
    return "\n".join(lines)
