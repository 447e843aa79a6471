"""Drafter training over several ranks on the CPU: data parallel under torchrun, and a target split
over tensor-parallel ranks (`train-draft --tp`); each against one process doing the same work."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import eaglet.train.trainer as trainer_mod

from .test_train import config, data, make_trainer, target  # noqa: F401 - fixtures

pytestmark = pytest.mark.usefixtures("one_thread")


def test_two_ranks_train_what_one_process_accumulating_their_batches_does(data, target, tiny_dirs, tmp_path):
    """Data parallel: `torchrun --nproc-per-node 2 -m eaglet train-draft` (gloo on the CPU) exports,
    bit for bit, the drafter of one process that accumulates the same two batches per step
    (--grad-accum 2). Without the all-reduce rank 0 would follow its own batches alone."""
    steps = 4
    one = make_trainer(config(data[0], tmp_path / "one", max_steps=steps, grad_accum=2), target)
    one.train()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "eaglet", "train-draft", "--model", str(tiny_dirs["llama3"][0]), "--device", "cpu",
           "--dtype", "float32", "--data", str(data[0]), "--out", str(tmp_path / "ddp"), "--lr", "3e-3",
           "--batch-tokens", "256", "--ttt-steps", "3", "--draft-vocab", "64", "--epochs", "5",
           "--save-every", "10", "--seed", "0", "--max-steps", str(steps)]
    r = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=Path(__file__).parents[1],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    a = load_file(tmp_path / "one" / "drafter" / "model.safetensors")
    b = load_file(tmp_path / "ddp" / "drafter" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ddp = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("{")))
    assert ddp["steps"] == steps and ddp["world_size"] == 2
    assert ddp["assistant_tokens_this_run"] == sum(int(m.sum()) for m in (
        trainer_mod.collate(one.rows, one.plan[i], 1024, "cpu")[1] for i in range(2 * steps)))


def test_tensor_parallel_target_trains_what_the_whole_one_does(data, target, tiny_dirs, tmp_path):
    """`train-draft --tp 2` (gloo workers on the CPU): the target split over two ranks, the head
    replicated and trained on the same batches on both; rank 0 exports. Its losses equal those of
    one process with the whole target within 1e-5, and so does the exported drafter."""
    from eaglet.cli import main

    steps = 4
    one = make_trainer(config(data[0], tmp_path / "one", max_steps=steps), target)
    one.train()
    assert main(["train-draft", "--model", str(tiny_dirs["llama3"][0]), "--device", "cpu", "--dtype", "float32",
                 "--data", str(data[0]), "--out", str(tmp_path / "tp"), "--lr", "3e-3", "--batch-tokens", "256",
                 "--ttt-steps", "3", "--draft-vocab", "64", "--epochs", "5", "--save-every", "10", "--seed", "0",
                 "--max-steps", str(steps), "--tp", "2"]) == 0
    got = json.loads((tmp_path / "tp" / "history.json").read_text())
    assert [h["step"] for h in got] == [h["step"] for h in one.history] and len(got) >= 1
    for a, b in zip(got, one.history):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * max(1.0, abs(b["loss"])), (a, b)
    a = load_file(tmp_path / "one" / "drafter" / "model.safetensors")
    b = load_file(tmp_path / "tp" / "drafter" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-5, rtol=1e-4) for k in a)
