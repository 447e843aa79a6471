"""Speculation settings and the CLI's speculative paths: SpecConfig refusals (API and flags), drafters
that do not fit the target through `eaglet generate` (one `eaglet: error:` line, no traceback), a
draft model with another vocabulary, and the happy paths (ngram, eagle3, draft) with their stats."""
import re
import shutil

import pytest
import torch

from eaglet.cli import main
from eaglet.config import ModelConfig, SpecConfig
from eaglet.errors import InvalidInput, ModelLoadError
from eaglet.spec.drafters.eagle3_ckpt import save_eagle3
from eaglet.spec.drafters.eagle3_head import Eagle3Config
from eaglet.spec.speculator import load_speculator
from eaglet.weights import load_model

from .conftest import hf_model, make_tiny_tokenizer
from .test_eagle3_ckpt import BAD_DRAFTERS, random_head, write_bad_drafter


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_error_line(rc: int, err: str, says: str) -> None:
    lines = err.strip().splitlines()
    assert rc == 1 and len(lines) == 1, err
    assert lines[0].startswith("eaglet: error: ") and says in lines[0]
    assert "Traceback" not in err


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLET_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def model_dir(tiny_dirs, tmp_path_factory):
    """The tiny llama3 directory with a tokenizer."""
    d = shutil.copytree(tiny_dirs["llama3"][0], tmp_path_factory.mktemp("spec_cli") / "tiny")
    make_tiny_tokenizer().save_pretrained(str(d))
    return d


@pytest.fixture(scope="module")
def drafter_dir(model_dir, tmp_path_factory):
    """A random EAGLE-3 head for the tiny model, saved in the SGLang format."""
    cfg = Eagle3Config.for_target(ModelConfig.from_file(model_dir / "config.json"), draft_vocab_size=40)
    return save_eagle3(random_head(cfg), tmp_path_factory.mktemp("drafter") / "eagle3", dtype=torch.float32)


def gen_args(model, *extra: str) -> list[str]:
    return ["generate", "the quick brown", "--model", str(model), "--device", "cpu", "--max-new-tokens", "16", *extra]


# ---- SpecConfig ---------------------------------------------------------------------------------

REFUSED = [  # (SpecConfig kwargs, the same as flags, what the error must say)
    (dict(steps=3, topk=2, draft_tokens=3), "--spec-steps 3 --spec-topk 2 --spec-draft-tokens 3",
     "--spec-draft-tokens 3 is smaller than the tree needs"),
    (dict(steps=3, draft_tokens=6), "--spec-steps 3 --spec-draft-tokens 6",
     "a chain of 3 steps verifies exactly 4 tokens"),
    (dict(steps=3, topk=2), "--spec-steps 3 --spec-topk 2", "needs --spec-draft-tokens"),
    (dict(steps=2, topk=2, draft_tokens=8), "--spec-steps 2 --spec-topk 2 --spec-draft-tokens 8",
     "exceeds the 7 nodes"),  # 1 + topk + (steps - 1) * topk**2
    (dict(steps=0), "--spec-steps 0", "--spec-steps must be a positive integer, got 0"),
    (dict(topk=-1), "--spec-topk -1", "--spec-topk must be a positive integer, got -1"),
    (dict(steps=33), "--spec-steps 33", "at most 32"),
]


@pytest.mark.parametrize("kwargs, flags, says", REFUSED, ids=[r[1] for r in REFUSED])
def test_spec_config_refused(kwargs, flags, says):
    with pytest.raises(InvalidInput) as e:
        SpecConfig("eagle3", **kwargs)
    assert says in str(e.value)


@pytest.mark.parametrize("kwargs, flags, says", REFUSED, ids=[r[1] for r in REFUSED])
def test_spec_flags_refused_by_cli(capsys, model_dir, kwargs, flags, says):
    rc, out, err = run_cli(capsys, *gen_args(model_dir, "--spec", "eagle3", *flags.split()))
    assert_one_error_line(rc, err, says)
    assert out == ""


def test_spec_config_limits_are_exact():
    assert SpecConfig("eagle3", steps=3).draft_tokens == 4  # a chain verifies steps + 1
    assert SpecConfig("eagle3", steps=3, topk=2, draft_tokens=4).draft_tokens == 4  # the smallest tree budget
    assert SpecConfig("eagle3", steps=2, topk=2, draft_tokens=7).draft_tokens == 7  # the largest for depth 2, k 2


# ---- drafters that do not fit -------------------------------------------------------------------

@pytest.mark.parametrize("name", BAD_DRAFTERS)
def test_bad_drafter_through_cli(capsys, model_dir, tmp_path, name):
    says = write_bad_drafter(name, tmp_path / "d", ModelConfig.from_file(model_dir / "config.json"))
    rc, out, err = run_cli(capsys, *gen_args(model_dir, "--spec", "eagle3", "--draft", str(tmp_path / "d")))
    assert_one_error_line(rc, err, says)
    assert out == ""


@pytest.mark.parametrize("method", ["eagle3", "draft"])
def test_spec_without_draft_path(capsys, model_dir, method):
    rc, out, err = run_cli(capsys, *gen_args(model_dir, "--spec", method))
    assert_one_error_line(rc, err, f"--spec {method} needs --draft PATH")


def test_draft_model_with_another_vocabulary(capsys, model_dir, tmp_path):
    hf_model("llama3", vocab_size=256).save_pretrained(tmp_path / "big_vocab", safe_serialization=True)
    capsys.readouterr()  # transformers' progress bar
    target = load_model(model_dir, dtype="float32", device="cpu", tokenizer=False).model
    with pytest.raises(ModelLoadError) as e:
        load_speculator(SpecConfig("draft", draft=str(tmp_path / "big_vocab")), target)
    assert "draft model vocabulary 256 does not match the target's 128" in str(e.value)
    rc, out, err = run_cli(capsys, *gen_args(model_dir, "--spec", "draft", "--draft", str(tmp_path / "big_vocab")))
    assert_one_error_line(rc, err, "draft model vocabulary 256 does not match the target's 128")


# ---- happy paths --------------------------------------------------------------------------------

def accept_length(err: str, method: str) -> float:
    [stats] = err.strip().splitlines()
    assert stats.startswith("[eaglet] prompt tokens ") and "tok/s" in stats
    m = re.search(rf"\| {method} accept length (\d+\.\d+)$", stats)
    assert m, stats
    return float(m.group(1))


def plain_out(capsys, model_dir) -> str:
    rc, out, err = run_cli(capsys, *gen_args(model_dir, "--spec", "none"))
    assert rc == 0 and out.strip() and "accept length" not in err
    return out


def test_ngram_prints_accept_length(capsys, model_dir):
    want = plain_out(capsys, model_dir)
    rc, out, err = run_cli(capsys, *gen_args(model_dir, "--spec", "ngram", "--spec-steps", "3"))
    assert rc == 0 and out == want  # greedy speculation is lossless
    assert accept_length(err, "ngram") > 1.0  # the tiny model repeats itself ("owowow"): lookups hit


@pytest.mark.parametrize("flags", [["--spec", "eagle3"], [], ["--spec-topk", "2", "--spec-draft-tokens", "8"]])
def test_eagle3_with_saved_head(capsys, model_dir, drafter_dir, flags):
    """--draft alone implies eagle3; a tree works too. A random head is lossless, if rarely accepted."""
    want = plain_out(capsys, model_dir)
    rc, out, err = run_cli(capsys, *gen_args(model_dir, "--draft", str(drafter_dir), *flags))
    assert rc == 0 and out == want
    assert accept_length(err, "eagle3") >= 1.0


def test_draft_model_that_is_the_target_is_always_accepted(capsys, model_dir):
    want = plain_out(capsys, model_dir)
    rc, out, err = run_cli(capsys, *gen_args(model_dir, "--spec", "draft", "--draft", str(model_dir),
                                             "--spec-steps", "3"))
    assert rc == 0 and out == want
    assert accept_length(err, "draft") > 3.0  # 4 per verify (3 drafts + bonus) until the budget cuts the last


def test_default_draft_depth_follows_the_device():
    """Unset --spec-steps: a chain of one draft on the CPU (the measured best there), else five."""
    from eaglet.cli import build_parser, spec_config

    args = build_parser().parse_args(["generate", "x", "--spec", "ngram", "--device", "cpu"])
    assert spec_config(args, None).steps == 1
    args = build_parser().parse_args(["generate", "x", "--spec", "ngram", "--device", "cpu", "--spec-steps", "4"])
    assert spec_config(args, None).steps == 4
    args = build_parser().parse_args(["generate", "x", "--device", "cpu", "--spec-topk", "4", "--spec-draft-tokens", "8",
                                      "--spec", "ngram"])
    assert spec_config(args, None).steps == 5  # a tree keeps its depth
    if torch.cuda.is_available():
        args = build_parser().parse_args(["generate", "x", "--spec", "ngram", "--device", "cuda"])
        assert spec_config(args, None).steps == 5


def test_default_setting_on_the_gpu(monkeypatch):
    """Unset --spec-steps/--spec-topk/--spec-draft-tokens on the GPU: EAGLE-3 drafts tree 5,4,16 (its
    best measured setting on the H200), other drafters a chain of 5; any flag given keeps the rest
    at their chain defaults."""
    from eaglet import cli
    from eaglet.weights import loader

    monkeypatch.setattr(loader, "resolve_device", lambda d: torch.device("cuda"))

    def cfg(*flags):
        return cli.spec_config(cli.build_parser().parse_args(["generate", "x", "--device", "cuda", *flags]), None)

    c = cfg("--spec", "eagle3", "--draft", "d")
    assert (c.steps, c.topk, c.draft_tokens) == (5, 4, 16)
    c = cfg("--spec", "ngram")
    assert (c.steps, c.topk) == (5, 1)
    c = cfg("--spec", "eagle3", "--draft", "d", "--spec-steps", "3")
    assert (c.steps, c.topk, c.draft_tokens) == (3, 1, 4)
    c = cfg("--spec", "eagle3", "--draft", "d", "--spec-topk", "8", "--spec-draft-tokens", "32")
    assert (c.steps, c.topk, c.draft_tokens) == (5, 8, 32)
