"""`eaglet serve --engine-process`: the engine spawned in a process of its own (server/remote.py)
behind the same routes. Greedy replies equal Generator's (plain and EAGLE-3, streamed and not, eight
at once); /metrics comes from the child; a client that leaves frees its row; a killed engine
process turns open requests and /health into 503; a load failure in the child is one error line;
the pipe's frames are parsed whole from partial reads; an error the engine process raises reaches its request."""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import pickle
import threading

import httpx
import pytest

from eaglet.cli import main
from eaglet.errors import EagletError
from eaglet.server.app import serve_app
from eaglet.server.remote import EngineClient, take_frames

from .engine_factory import failing_engine, step_failing_engine, tiny_engine
from .serving import PROMPTS, LiveServer, kv_empty, reference, speculator, wait_for


@pytest.mark.parametrize("kind", ["plain", "eagle3"])
def test_engine_process_replies_equal_the_generator(tiny, model_dir, drafter_dir, kind):
    sp = speculator(tiny, drafter_dir, kind)
    client = EngineClient(tiny_engine, model_dir, drafter_dir, kind)
    with LiveServer(None, app=serve_app(client)) as srv:
        c = srv.client()
        prompt = PROMPTS[0]
        want = reference(tiny, sp, prompt, 24, chat=True)
        r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=24,
                                      temperature=0)
        assert r.choices[0].message.content == want
        assert (r.usage.accept_length is None) == (sp is None)
        streamed = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                             max_tokens=24, temperature=0, stream=True)
        assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == want

        async def many():
            ac = srv.async_client()
            rs = await asyncio.gather(*(ac.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0)
                                        for p in PROMPTS))
            return [x.choices[0].text for x in rs]
        assert asyncio.run(many()) == [reference(tiny, sp, p, 16, chat=False) for p in PROMPTS]
        m = srv.metrics()  # the child's registry
        assert m["eaglet:request_success_total{finished_reason=length}"] >= 1 + len(PROMPTS)
        wait_for(lambda: kv_empty(srv), 10)
    assert not client.proc.is_alive()  # the app's shutdown ended the child


def test_engine_process_frees_a_leaving_clients_row_and_fails_when_killed(model_dir, drafter_dir):
    client = EngineClient(tiny_engine, model_dir, drafter_dir, "plain")
    with LiveServer(None, app=serve_app(client)) as srv:
        body = {"model": "tiny", "prompt": PROMPTS[1], "stream": True, "ignore_eos": True}  # to the context's end

        def first_events(then) -> list[str]:
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
                lines = r.iter_lines()
                seen = [next(line for line in lines if line.startswith("data: ")) for _ in range(2)]
                then()
                return seen + [line for line in lines if line.startswith("data: ")] if then is kill else seen

        def leave():
            pass  # leaving the block closes the connection mid-stream

        def kill():
            client.proc.kill()

        first_events(leave)
        wait_for(lambda: kv_empty(srv) and srv.metrics()["eaglet:request_aborted_total"] == 1, 10)
        events = first_events(kill)
        assert '"engine_dead"' in events[-2] and events[-1] == "data: [DONE]"
        h = httpx.get(srv.url + "/health")
        assert h.status_code == 503 and h.json()["error"]["code"] == "engine_dead"
        r = httpx.post(srv.url + "/v1/completions", json={**body, "stream": False})
        assert r.status_code == 503


def test_an_error_in_the_engine_process_reaches_its_request(model_dir):
    client = EngineClient(step_failing_engine, model_dir)
    with LiveServer(None, app=serve_app(client)) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 8},
                       timeout=30)
        assert r.status_code == 500 and r.json()["error"]["message"] == "internal error: RuntimeError: step bug"
        assert httpx.get(srv.url + "/health").status_code == 200  # a failed batch, not a dead engine


def test_engine_process_load_failure_is_one_line(tmp_path, capsys):
    with pytest.raises(EagletError, match="no weights here"):
        EngineClient(failing_engine, "no weights here")
    assert main(["serve", "--engine-process", "--model", str(tmp_path), "--device", "cpu", "--spec", "none"]) == 1
    err = capsys.readouterr().err
    assert str(tmp_path) in err and "Traceback" not in err


def test_frames_are_taken_whole_from_partial_reads():
    reader, writer = mp.Pipe(duplex=False)
    msgs = [("chunks", [("r", "x" * 70_000, False)]), ("metrics", b"m" * 10), ("stopped", None)]
    # the first is larger than a pipe's buffer: written from a thread while read here
    t = threading.Thread(target=lambda: [writer.send(m) for m in msgs])
    t.start()
    buf, got = bytearray(), []
    while len(got) < len(msgs):
        buf += os.read(reader.fileno(), 1000)  # a frame arrives in many pieces
        got += take_frames(buf)
    t.join()
    assert got == msgs and not buf
    buf += b"\x00\x00\x00\x03bad" + bytes(buf)  # a frame that does not unpickle is dropped, not read again
    with pytest.raises(pickle.UnpicklingError):
        take_frames(buf)
    assert not buf
