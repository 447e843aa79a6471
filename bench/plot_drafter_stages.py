"""τ of the bundled SmolLM2 drafter stage by stage, against the assistant tokens trained on the way
there, from the committed train-draft and eval-draft records (nothing is run):

    .venv/bin/python bench/plot_drafter_stages.py   # writes bench/results/drafter-stages.{json,png}

The bundled lineage is 1-12, 15, 16, 18-25, 27-30, 32, 37 (each stage starts from the one before); 13, 14,
17, 26, 31, 33-36 and 38-56 branched off it (45-47 and 55-56 off those branches) and were not kept, so they are drawn apart. A stage evaluated on the H200 is
read from its `-h200` records (chain 5 and the other settings merged when they were run apart, as for
stage 30); one evaluated on the CPU (29, 32, 37's MT-bench settings) from its `-cpu` records, merged likewise, and with its H200 records
where it has some (the CPU accepts the same counts as the GPU: stage 27's records).
"""
from __future__ import annotations

import json
from pathlib import Path

from eaglet.perf.record import environment, to_json, write_atomic

RESULTS = Path(__file__).resolve().parent / "results"
LINEAGE = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 15, 16, 18, 19, 20, 21, 22, 23, 24, 25, 27, 28, 29, 30, 32, 37]
BRANCHES = {13: 12, 14: 12, 17: 16, 26: 25, 31: 29, 33: 32, 34: 32, 35: 32, 36: 32, 38: 32, 39: 32,
            40: 37, 41: 37, 42: 37, 43: 37, 44: 37, 45: 42, 46: 43, 47: 46,
            48: 37, 49: 37, 50: 37, 51: 37, 52: 37, 53: 37, 54: 37, 55: 53, 56: 54}  # stage: the stage it started from
SETTINGS = ("chain:5", "tree:6,8,32")
SETS = ("mtbench", "humaneval")
NEW_DATA = {1: "ShareGPT", 5: "unseen ShareGPT", 7: "self-written", 18: "task openings", 21: "more openings", 23: "122,880 new turns", 25: "61,440 new turns", 27: "102,400 new turns", 28: "STEM openings", 29: "96,816 new turns", 30: "18,432-id vocabulary", 32: "68,570 new turns", 37: "code prompts"}
BAR = 3.5
READ: set[str] = set()  # the records the figure is drawn from, named in its JSON


def train_records(stage: int) -> list[dict]:
    """A stage's train-draft records: one, or one per device call when it resumed (stage23-call1, -call2)."""
    paths = sorted(RESULTS.glob(f"train-draft-smollm2-h200*-stage{stage}[.-]*json"))
    assert paths, f"no train-draft record of stage {stage}"
    READ.update(p.name for p in paths)
    return [json.loads(p.read_text()) for p in paths]


EVAL_NAMES = {4: "", 13: "stage13-wide6144-", 14: "stage14-hard-"}  # stage 4's records carry no stage in their names


def eval_record(stage: int, prompts: str) -> dict | None:
    """The stage's results on one prompt set: its CPU records, then its H200 ones (a setting both ran is
    the H200's; they accept the same counts); a setting run apart (`-settings-` records) merged in."""
    name = f"eval-draft-smollm2-{EVAL_NAMES.get(stage, f'stage{stage}-')}{prompts}"
    results = {}
    for device in ("cpu", "h200"):
        for p in (RESULTS / f"{name}-{device}.json", RESULTS / f"{name}-settings-{device}.json"):
            if p.exists():
                READ.add(p.name)
                results.update(json.loads(p.read_text())["results"])
    return {"results": results} if results else None


def tokens(stage: int) -> int:
    return sum(r["results"]["assistant_tokens_this_run"] for r in train_records(stage))


def collect() -> list[dict]:
    rows, cum, total = [], {}, 0
    for stage in LINEAGE:
        total += tokens(stage)
        cum[stage] = total
    for stage in sorted(BRANCHES):  # a branch's tokens: its parent's (lineage or branch), then its own
        cum[stage] = cum[BRANCHES[stage]] + tokens(stage)
    for stage in LINEAGE + sorted(BRANCHES):
        at = cum[stage]
        row = {"stage": stage, "bundled_lineage": stage in LINEAGE, "assistant_tokens_cumulative": at}
        for prompts in SETS:
            rec = eval_record(stage, prompts)
            for s in SETTINGS:
                row[f"{prompts} {s}"] = round(rec["results"][s]["accept_length"], 4) if rec and s in rec["results"] else None
        rows.append(row)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8))
    def points(key: str, kept: bool) -> list[tuple[float, float]]:
        return [(r["assistant_tokens_cumulative"] / 1e6, r[key]) for r in rows if r["bundled_lineage"] == kept and r[key]]

    for prompts, color in zip(SETS, ("tab:blue", "tab:orange")):
        for s, style in zip(SETTINGS, ("-o", "--s")):
            key = f"{prompts} {s}"
            ax.plot(*zip(*points(key, True)), style, color=color, ms=4, label=key.replace(":", " "))
            if side := points(key, False):
                ax.plot(*zip(*side), "x", color=color, ms=6)
    for stage, what in NEW_DATA.items():
        x = next(r["assistant_tokens_cumulative"] for r in rows if r["stage"] == stage) / 1e6
        ax.axvline(x, color="0.85", lw=0.8, zorder=0)
        ax.text(x, 5.3, f"{stage}: {what} ", rotation=90, va="top", ha="right", fontsize=7, color="0.4")
    ax.axhline(BAR, color="red", lw=0.8, ls=":")
    ax.text(2, BAR + 0.03, "bar: chain 5 >= 3.5", color="red", fontsize=8)
    ax.set_xlabel("assistant tokens trained, cumulative (M); x: stages not kept")
    ax.set_ylabel("τ (tokens per verify step)")
    ax.set_title("Bundled SmolLM2-135M-Instruct EAGLE-3 drafter, greedy, 256 new tokens")
    ax.set_ylim(1.5, 5.35)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    rows = collect()
    out = RESULTS / "drafter-stages.json"
    sources = sorted(READ)
    write_atomic(out, to_json({"kind": "drafter-stages", "command": "python bench/plot_drafter_stages.py",
                               "environment": environment(), "derived_from": sources, "rows": rows}))
    plot(rows, RESULTS / "drafter-stages.png")
    for r in rows:
        print(r)


if __name__ == "__main__":
    main()
