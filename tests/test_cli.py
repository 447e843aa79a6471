"""The CLI's bad-input contract: one line on stderr starting `eaglet: error:`, no traceback, exit
status 1. Plus the happy path of `generate` on a tiny model directory with a tokenizer, and --help."""
import json
import re
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from eaglet.cli import main

CONTEXT = 32
MISSING = "model.layers.1.mlp.up_proj.weight"


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_error_line(rc: int, err: str, *must_contain: str) -> None:
    assert rc == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("eaglet: error: ")
    assert "Traceback" not in err
    for s in must_contain:
        assert s in lines[0]


def copy_tiny(tiny_dirs, dst):
    src = tiny_dirs["llama3"][0]
    shutil.copytree(src, dst)
    return dst


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """GGUF conversions go to a per-test cache, never the user's."""
    monkeypatch.setenv("EAGLET_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def model_dir(tiny_dirs, tmp_path_factory):
    """The tiny llama3 directory with a tokenizer and a 32-token context."""
    from .conftest import make_tiny_tokenizer

    d = copy_tiny(tiny_dirs, tmp_path_factory.mktemp("cli") / "tiny")
    cfg = json.loads((d / "config.json").read_text())
    cfg["max_position_embeddings"] = CONTEXT
    (d / "config.json").write_text(json.dumps(cfg))
    make_tiny_tokenizer().save_pretrained(str(d))
    return d


def gen_args(model, *extra: str) -> list[str]:
    return ["generate", "the quick brown", "--model", str(model), "--device", "cpu", "--max-new-tokens", "8", *extra]


# ---- bad input ----------------------------------------------------------------------------------

def test_missing_model_path(capsys, tmp_path):
    rc, out, err = run_cli(capsys, *gen_args(tmp_path / "nope"))
    assert_one_error_line(rc, err, "nope", "does not exist")


def test_gguf_of_unsupported_architecture(capsys, tmp_path):
    import gguf

    path = tmp_path / "gemma.gguf"
    w = gguf.GGUFWriter(str(path), arch="gemma3")  # writes general.architecture = "gemma3"
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    rc, out, err = run_cli(capsys, *gen_args(path))
    assert_one_error_line(rc, err, "gemma3", "not supported")


def test_missing_tensor_is_named(capsys, tiny_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    d = copy_tiny(tiny_dirs, tmp_path / "broken")
    state = load_file(str(d / "model.safetensors"))
    del state[MISSING]
    save_file(state, str(d / "model.safetensors"))
    rc, out, err = run_cli(capsys, *gen_args(d))
    assert_one_error_line(rc, err, "missing tensor", MISSING)


def test_prompt_longer_than_context(capsys, model_dir):
    prompt = " ".join(["the quick brown fox"] * 20)  # well over 32 tokens
    rc, out, err = run_cli(capsys, "generate", prompt, "--model", str(model_dir), "--device", "cpu")
    assert_one_error_line(rc, err, "context is 32")
    assert out == ""


@pytest.mark.parametrize("flags, word", [(["--temperature", "-1"], "temperature"), (["--top-p", "0"], "top_p"),
                                         (["--top-p", "1.5"], "top_p"), (["--top-k", "-2"], "top_k"),
                                         (["--max-new-tokens", "0"], "max_new_tokens")])
def test_invalid_sampling_parameter(capsys, model_dir, flags, word):
    rc, out, err = run_cli(capsys, *gen_args(model_dir, *flags))
    assert_one_error_line(rc, err, word)
    assert out == ""


def test_directory_without_tokenizer(capsys, tiny_dirs):
    rc, out, err = run_cli(capsys, *gen_args(tiny_dirs["llama3"][0]))
    assert_one_error_line(rc, err, "no tokenizer")


def test_subprocess_has_no_traceback(tmp_path):
    """End to end through `python -m eaglet`: the process itself exits 1 with the one line."""
    proc = subprocess.run([sys.executable, "-m", "eaglet", *gen_args(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "EAGLET_CACHE": str(tmp_path / "cache")})
    assert_one_error_line(proc.returncode, proc.stderr, "does not exist")
    assert proc.stdout == ""


def test_bad_flag_is_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "hi", "--max-new-tokens", "many"])
    assert e.value.code == 2
    assert "invalid int value" in capsys.readouterr().err


# ---- happy path ---------------------------------------------------------------------------------

def test_generate_prints_text_and_stats(capsys, model_dir):
    rc, out, err = run_cli(capsys, *gen_args(model_dir))
    assert rc == 0
    assert out.endswith("\n") and out.strip()
    [stats] = err.strip().splitlines()
    assert stats.startswith("[eaglet] prompt tokens ") and "tok/s" in stats


def test_generate_stop_string(capsys, model_dir):
    rc, free, _ = run_cli(capsys, *gen_args(model_dir))
    stop = free.strip()[3:6]
    rc, out, err = run_cli(capsys, *gen_args(model_dir, "--stop", stop))
    assert rc == 0
    assert out == free[: free.find(stop)] + "\n"


@pytest.mark.parametrize("argv, text", [(["--help"], "usage: eaglet"),
                                        (["generate", "--help"], "--temperature")])
def test_help_exits_zero(capsys, argv, text):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    assert text in capsys.readouterr().out


def test_compare_plain_prints_medians_and_speedup(capsys, model_dir):
    rc = main(["generate", "hello", "--model", str(model_dir), "--device", "cpu", "--max-new-tokens", "6",
               "--spec", "ngram", "--compare-plain"])
    err = capsys.readouterr().err
    assert rc == 0
    assert re.search(r"speculative [\d.]+ tok/s, plain [\d.]+ tok/s \(same tokens; medians of 3 alternating runs\) "
                     r"\| speculative speedup [\d.]+x", err), err


@pytest.mark.parametrize("argv", [["bench", "--device", "cpu"], ["profile", "--device", "cpu"],
                                  ["eval-draft", "--device", "cpu"], ["train-draft", "--data", "d"],
                                  ["data"], ["bench-serve"]])
def test_out_that_is_a_file_is_refused_before_any_work(capsys, tmp_path, argv):
    """Every --out is a directory; a file there is one error line, before a model is loaded."""
    f = tmp_path / "results"
    f.write_text("not a directory")
    assert main(argv + ["--out", str(f)]) == 1
    err = capsys.readouterr().err
    assert err.strip() == f"eaglet: error: --out {f}: exists and is not a directory"


def test_os_errors_are_one_line(capsys, tmp_path, monkeypatch):
    """An OSError that is not a missing file (here: permission denied) is one line, no traceback."""
    import eaglet.cli as cli_mod

    def denied(args):
        raise PermissionError(13, "Permission denied", str(tmp_path / "x"))
    monkeypatch.setitem(cli_mod.COMMANDS, "compare", denied)
    assert main(["compare", "a.json", "b.json"]) == 1
    assert capsys.readouterr().err.strip() == f"eaglet: error: {tmp_path / 'x'}: Permission denied"


@pytest.mark.parametrize("flags, word", [(["--self-prompts", "-1"], "--self-prompts"),
                                         (["--self-prompts", "4", "--source", "x.json"], "--self-prompts"),
                                         (["--prompt-openers", "tasks"], "needs --self-prompts"),
                                         (["--self-prompts", "4", "--prompt-openers", "nope.txt"], "nope.txt")])
def test_data_self_prompts_bad_flags(capsys, model_dir, tmp_path, flags, word):
    rc, out, err = run_cli(capsys, "data", "--model", str(model_dir), "--device", "cpu", "--out", str(tmp_path / "d"), *flags)
    assert_one_error_line(rc, err, word)
    assert not (tmp_path / "d").exists()


@pytest.fixture
def chat_dir(model_dir, tmp_path):
    """The tiny model with a chat template (bench applies one)."""
    d = tmp_path / "chat"
    shutil.copytree(model_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def test_bench_times_systems_in_rounds_and_records_every_repeat(capsys, chat_dir, tmp_path, monkeypatch):
    """`eaglet bench` on the CPU: each system's warm-up, then rounds that run every system once in
    turn (a slow spell of a shared machine falls on all of them), and a record with each repeat's
    seconds, the median tok/s and whether the tokens equal plain's."""
    import statistics

    import eaglet.perf.bench as bench

    order, real = [], bench.run_systems

    def spy(fns, prompts, device, repeats):
        calls = {n: (lambda ids, n=n, f=f: (order.append(n), f(ids))) for n, f in fns.items()}
        return real(calls, prompts, device, repeats)
    monkeypatch.setattr(bench, "run_systems", spy)
    rc = main(["bench", "--model", str(chat_dir), "--device", "cpu", "--num-prompts", "2", "--max-new-tokens", "4",
               "--repeats", "3", "--systems", "plain", "ngram", "--out", str(tmp_path)])
    assert rc == 0, capsys.readouterr().err
    assert order == ["plain", "ngram"] + (["plain"] * 2 + ["ngram"] * 2) * 3  # warm-ups, then 3 rounds
    systems = json.loads(next(tmp_path.glob("bench-cpu-*.json")).read_text())["results"]["systems"]
    for r in systems.values():
        # the tiny model's context leaves one of the prompts fewer than 4 new tokens: tok/s counts those made
        assert len(r["seconds"]) == 3 and 2 <= r["new_tokens"] <= 2 * 4
        assert r["tok_s"] == pytest.approx(r["new_tokens"] / statistics.median(r["seconds"]))
    assert systems["ngram"]["tokens_equal_plain"] == "2/2"
    assert systems["ngram"]["vs_eaglet_plain"] == pytest.approx(systems["ngram"]["tok_s"] / systems["plain"]["tok_s"])


def test_bench_stop_at_eos_counts_each_systems_tokens(capsys, chat_dir, tmp_path):
    """--stop-at-eos: replies end at EOS and tok/s counts the tokens made. The model's EOS is set to
    the first token plain greedy decoding gives the first prompt, so that reply is one token long."""
    import statistics

    from eaglet import GenerationConfig, Generator, load_model
    from eaglet.perf.bench import bench_prompts

    loaded = load_model(str(chat_dir), device="cpu")
    ids = loaded.tokenizer.apply_chat([{"role": "user", "content": bench_prompts(None, 1)[0]}])
    first = Generator(loaded.model, loaded.tokenizer).generate([ids], GenerationConfig(max_new_tokens=1, ignore_eos=True))
    config = json.loads((chat_dir / "config.json").read_text())
    config["eos_token_id"] = first[0].tokens[0]
    (chat_dir / "config.json").write_text(json.dumps(config))
    rc = main(["bench", "--model", str(chat_dir), "--device", "cpu", "--num-prompts", "2", "--max-new-tokens", "6",
               "--repeats", "1", "--systems", "plain", "ngram", "--stop-at-eos", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "(or up to EOS)" in out
    systems = json.loads(next(tmp_path.glob("bench-cpu-*.json")).read_text())["results"]["systems"]
    for r in systems.values():
        assert 2 <= r["new_tokens"] <= 1 + 6  # the first reply is its EOS alone
        assert r["tok_s"] == pytest.approx(r["new_tokens"] / statistics.median(r["seconds"]))
    assert systems["ngram"]["new_tokens"] == systems["plain"]["new_tokens"]
