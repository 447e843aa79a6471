"""`eaglet serve --tp 2` on CPUs (gloo): rank 0 serves the OpenAI API and leads, rank 1 follows its
decoder; the reply equals one process's; a killed worker turns /health to 503 and the server
exits within 30 s; a hung one fails the request in flight with 503 after the collective timeout."""
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import psutil

from eaglet.cli import main

from .serving import free_port
from .test_server import wait_for


def start(flags: list[str], port: int, **env) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    return subprocess.Popen([sys.executable, "-m", "eaglet", "serve", *flags, "--port", str(port),
                             "--served-model-name", "tiny", "--max-batch", "4"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def health(port: int) -> int | None:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code
    except httpx.TransportError:
        return None


def the_follower(proc: subprocess.Popen, port: int) -> psutil.Process:
    """Rank 1 of a `serve --tp 2`: the spawned worker that does not listen on `port`."""
    server = psutil.Process(proc.pid)
    listening = {p.pid for p in server.children(recursive=True)
                 if any(c.laddr.port == port and c.status == psutil.CONN_LISTEN for c in p.net_connections())}
    followers = [p for p in server.children() if p.pid not in listening and "spawn_main" in " ".join(p.cmdline())
                 and "resource_tracker" not in " ".join(p.cmdline())]
    assert len(listening) == 1 and len(followers) == 1, (listening, followers)
    return followers[0]


def test_tensor_parallel_server(model_dir, capsys, monkeypatch):
    monkeypatch.setenv("EAGLET_CACHE", str(model_dir.parent / "cache"))
    flags = ["--model", str(model_dir), "--device", "cpu", "--spec", "ngram", "--spec-steps", "3"]
    port = free_port()
    proc = start(flags + ["--tp", "2"], port)
    try:
        prompt = "the quick brown fox"
        assert main(["generate", "--chat", prompt, "--max-new-tokens", "20", *flags]) == 0
        want = capsys.readouterr().out[:-1]

        def up():
            assert proc.poll() is None, proc.stdout.read()
            return health(port) == 200
        wait_for(up, 120)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        for _ in range(2):  # a second request on the same (tensor-parallel) decoder
            r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                          max_tokens=20, temperature=0)
            assert r.choices[0].message.content == want

        # a follower dies: 503, then the whole server exits, well within 30 s
        follower = the_follower(proc, port)
        t0 = time.monotonic()
        follower.kill()
        wait_for(lambda: health(port) == 503, 15)
        proc.wait(timeout=30)
        assert time.monotonic() - t0 < 30
        out = proc.stdout.read()
        assert proc.returncode == 1 and "worker failed" in out and "tensor-parallel over 2 ranks" in out, out
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=30)


def test_records_of_tensor_parallel_runs_carry_every_ranks_nccl_settings(model_dir, tmp_path, capsys, monkeypatch):
    """`bench --tp 2` writes one record (rank 0's) whose environment holds each rank's NCCL_*
    settings at communicator creation; `eaglet compare` names the setting two runs differ in."""
    monkeypatch.setenv("EAGLET_CACHE", str(model_dir.parent / "cache"))
    paths = []
    for algo in ("Ring", "Tree"):
        out = tmp_path / algo
        assert main(["bench", "--model", str(model_dir), "--device", "cpu", "--systems", "plain", "ngram",
                     "--max-new-tokens", "8", "--num-prompts", "1", "--repeats", "1", "--out", str(out),
                     "--tp", "2", "--nccl-env", f"NCCL_ALGO={algo}"]) == 0
        records = sorted(out.glob("bench-*.json"))
        assert len(records) == 1  # rank 0's alone
        paths.append(records[0])
    import json
    tp = json.loads(paths[0].read_text())["environment"]["tensor_parallel"]
    assert tp["world"] == 2 and tp["backend"] == "gloo" and tp["errors"] == []
    assert [r["NCCL_ALGO"] for r in tp["at_creation"]] == ["Ring", "Ring"]
    capsys.readouterr()
    assert main(["compare", str(paths[0]), str(paths[1])]) == 0
    text = capsys.readouterr().out
    assert "environment.tensor_parallel.at_creation.1.NCCL_ALGO: \"Ring\" -> \"Tree\"" in text


def test_a_hung_worker_fails_the_request_in_flight_and_the_server_exits(model_dir, monkeypatch):
    """A follower that stops answering (SIGSTOP: alive, silent): the request in flight waits out the
    collective timeout (EAGLET_DIST_TIMEOUT) and gets 503 with an OpenAI-shaped error, not silence;
    /health turns 503 and the server exits with an error."""
    monkeypatch.setenv("EAGLET_CACHE", str(model_dir.parent / "cache"))
    port = free_port()
    proc = start(["--model", str(model_dir), "--device", "cpu", "--spec", "none", "--tp", "2"], port,
                 EAGLET_DIST_TIMEOUT="15")
    follower = None
    try:
        def up():
            assert proc.poll() is None, proc.stdout.read()
            return health(port) == 200
        wait_for(up, 120)
        follower = the_follower(proc, port)
        follower.suspend()
        t0 = time.monotonic()
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=90,
                       json={"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 20})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", r.text
        assert time.monotonic() - t0 < 45
        proc.wait(timeout=60)
        out = proc.stdout.read()
        assert proc.returncode == 1 and "worker failed" in out and "timed out" in out.lower(), out
    finally:
        if follower is not None and follower.is_running():
            follower.kill()
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
