"""`eaglet serve` on a tiny model, through a live uvicorn server on 127.0.0.1 and the real `openai`
client: chat and completion, streamed and not, equal to Generator's greedy output (plain and
speculative, alone and batched); a load test (200 requests at concurrency 32, 0 failures, the KV
cache empty afterwards, memory flat over a second round); 50 clients that drop mid-stream; bad
requests answered 4xx in the OpenAI error shape while /health stays 200; a full queue (429); an
internal failure that fails only its own request; a dead engine (503); the CLI end to end; the
speculation policy (a profile's per-batch-size choice, --spec-max-batch): one request speculates, a
burst that starts together decodes plain, a speculating batch that grows drains to plain."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import nullcontext

import httpx
import openai
import pytest
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from eaglet.cli import main
from eaglet.config import ModelConfig, SpecConfig
from eaglet.generate import GenerationConfig, Generator
from eaglet.server import batcher as batcher_mod
from eaglet.server import engine as engine_mod
from eaglet.server.app import build_app
from eaglet.server.policy import SpecPolicy, load_profile_policy
from eaglet.spec.drafters.eagle3_ckpt import save_eagle3
from eaglet.spec.drafters.eagle3_head import Eagle3Config
from eaglet.spec.speculator import Speculator, load_speculator
from eaglet.weights import load_model

from .conftest import make_tiny_tokenizer
from .test_eagle3_ckpt import random_head

TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant:{% endif %}")
PROMPTS = ["the quick brown fox", "pack my box with five dozen", "a stitch in time", "sphinx of black quartz",
           "how vexingly quick", "the lazy dog said", "judge my vow", "0123456789 yes"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """build_app (or a given app) + uvicorn on a free port of 127.0.0.1, in a thread."""

    def __init__(self, generator: Generator | None, name: str = "tiny", app=None, **kw):
        self.app = app or build_app(generator, name, **kw)
        self.engine = self.app.state.engine
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(20)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=60)

    def metrics(self) -> dict[str, float]:
        return scrape(httpx.get(self.url + "/metrics").text)


def scrape(text: str) -> dict[str, float]:
    """name{other labels} -> value, model_name dropped."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def wait_for(cond, timeout: float) -> float:
    """Seconds until cond() held; fails after `timeout`."""
    t0 = time.perf_counter()
    while not cond():
        assert time.perf_counter() - t0 < timeout, "timed out"
        time.sleep(0.02)
    return time.perf_counter() - t0


def kv_empty(srv: LiveServer) -> bool:
    m = srv.metrics()
    return (m["eaglet:kv_cache_free_tokens"] == m["eaglet:kv_cache_total_tokens"] > 0
            and m["eaglet:num_requests_running"] == 0 and m["eaglet:num_requests_waiting"] == 0)


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


# ---- fixtures -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tiny_dirs, tmp_path_factory):
    """The tiny llama3 directory with a tokenizer that has a chat template."""
    d = shutil.copytree(tiny_dirs["llama3"][0], tmp_path_factory.mktemp("serve") / "tiny")
    tok = make_tiny_tokenizer()
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(d))
    return d


@pytest.fixture(scope="module")
def tiny(model_dir, one_thread):
    return load_model(model_dir, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def drafter_dir(model_dir, tmp_path_factory):
    cfg = Eagle3Config.for_target(ModelConfig.from_file(model_dir / "config.json"), draft_vocab_size=40)
    return save_eagle3(random_head(cfg), tmp_path_factory.mktemp("drafter") / "eagle3", dtype=torch.float32)


SPECS = {"plain": None, "ngram": SpecConfig("ngram", steps=3), "eagle3": None}


def speculator(tiny, drafter_dir, kind: str):
    if kind == "plain":
        return None
    spec = SpecConfig("eagle3", draft=str(drafter_dir), steps=3) if kind == "eagle3" else SPECS[kind]
    return load_speculator(spec, tiny.model, tiny.path)


@pytest.fixture(scope="module")
def plain(tiny):
    with LiveServer(Generator(tiny.model, tiny.tokenizer), max_batch=16, max_queue=64) as srv:
        yield srv


def reference(tiny, sp, prompt: str, max_tokens: int, chat: bool, stop=()) -> str:
    tok = tiny.tokenizer
    ids = tok.apply_chat([{"role": "user", "content": prompt}]) if chat else tok.encode(prompt)
    [c] = Generator(tiny.model, tok, sp).generate([ids], GenerationConfig(max_tokens, stop=tuple(stop)))
    return c.text


# ---- the OpenAI client --------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["plain", "ngram", "eagle3"])
def test_greedy_through_the_server_equals_generator(tiny, drafter_dir, plain, kind):
    sp = speculator(tiny, drafter_dir, kind)
    live = nullcontext(plain) if kind == "plain" else LiveServer(Generator(tiny.model, tiny.tokenizer, sp), max_batch=4)
    with live as srv:
        c = srv.client()
        for prompt in PROMPTS[:3]:
            want = reference(tiny, sp, prompt, 24, chat=True)
            r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=24,
                                          temperature=0)
            assert r.choices[0].message.content == want and r.object == "chat.completion"
            u = r.usage
            assert u.prompt_tokens + u.completion_tokens == u.total_tokens and u.completion_tokens >= 1
            if sp is None:
                assert u.accept_length is None
            else:  # τ and the counters it comes from
                s = u.spec_decode
                assert s["num_drafts"] >= 1
                assert u.accept_length == pytest.approx(1 + s["num_accepted_tokens"] / s["num_drafts"])
            chunks = list(c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                                    max_tokens=24, temperature=0, stream=True,
                                                    stream_options={"include_usage": True}))
            assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
            assert chunks[0].choices[0].delta.role == "assistant"
            assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == r.choices[0].finish_reason
            assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == u.completion_tokens

            want = reference(tiny, sp, prompt, 16, chat=False)
            r = c.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0)
            assert r.choices[0].text == want and r.usage.completion_tokens >= 1
            streamed = c.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0, stream=True)
            assert "".join(ch.choices[0].text for ch in streamed) == want
        if sp is not None:
            m = srv.metrics()
            assert m["eaglet:spec_decode_num_drafts_total"] >= 1
            assert m["eaglet:spec_decode_num_draft_tokens_total"] >= m["eaglet:spec_decode_num_accepted_tokens_total"]
            per_pos = sum(v for k, v in m.items()
                          if k.startswith("eaglet:spec_decode_num_accepted_tokens_per_pos_total"))
            assert per_pos == m["eaglet:spec_decode_num_accepted_tokens_total"]


def test_stop_strings_token_ids_and_models(tiny, plain):
    c = plain.client()
    full = reference(tiny, None, PROMPTS[0], 24, chat=False)
    stop = full[5:7]  # cuts the text before its first occurrence
    r = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].text == reference(tiny, None, PROMPTS[0], 24, chat=False, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].text
    ids = tiny.tokenizer.encode(PROMPTS[0])
    r = c.completions.create(model="tiny", prompt=ids, max_tokens=24, temperature=0)
    assert r.choices[0].text == full and r.usage.prompt_tokens == len(ids)
    [card] = c.models.list().data
    assert card.id == "tiny" and card.max_model_len == tiny.config.max_position


def test_sampled_and_greedy_requests_mix(tiny, plain):
    """Rows share sampling settings: mixed requests are grouped and all complete; a seeded request
    is repeatable."""
    async def go():
        c = plain.async_client()
        reqs = [c.completions.create(model="tiny", prompt=p, max_tokens=10, temperature=t, top_p=tp, seed=s)
                for p in PROMPTS[:4] for t, tp, s in [(0, None, None), (0.8, 0.9, None), (1.0, None, 7)]]
        return await asyncio.gather(*reqs)

    rs = asyncio.run(go())
    assert all(r.usage.completion_tokens >= 1 for r in rs)
    c = plain.client()
    a, b = (c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=10, temperature=1.0, seed=3)
            for _ in range(2))
    assert a.choices[0].text == b.choices[0].text
    assert rs[0].choices[0].text == reference(tiny, None, PROMPTS[0], 10, chat=False)


# ---- load and disconnects -----------------------------------------------------------------------

async def load_round(srv: LiveServer, n: int, concurrency: int, max_tokens: int) -> list[tuple[int, str]]:
    """n requests, at most `concurrency` in flight; chat/completion, streamed or not, in turn.
    Returns (prompt index, text) per request; any failure raises."""
    c, sem = srv.async_client(), asyncio.Semaphore(concurrency)

    async def one(i: int):
        p, chat, stream = i % len(PROMPTS), i % 2 == 0, i % 4 < 2
        async with sem:
            if chat:
                kw = {"model": "tiny", "messages": [{"role": "user", "content": PROMPTS[p]}],
                      "max_tokens": max_tokens, "temperature": 0}
                if stream:
                    return p, "".join([ch.choices[0].delta.content or "" async for ch in
                                       await c.chat.completions.create(stream=True, **kw)])
                return p, (await c.chat.completions.create(**kw)).choices[0].message.content
            kw = {"model": "tiny", "prompt": PROMPTS[p], "max_tokens": max_tokens, "temperature": 0}
            if stream:
                return p, "".join([ch.choices[0].text async for ch in await c.completions.create(stream=True, **kw)])
            return p, (await c.completions.create(**kw)).choices[0].text

    try:
        return await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        await c.close()


def test_load_200_requests_at_concurrency_32(tiny, plain):
    want = {(p, chat): reference(tiny, None, PROMPTS[p], 12, chat) for p in range(len(PROMPTS)) for chat in (0, 1)}
    before = plain.metrics()
    rss = []
    for _ in range(2):  # a second identical round: memory stays flat
        out = asyncio.run(load_round(plain, 200, 32, 12))
        # batched, queued, streamed or not: every text equals the prompt's greedy output alone
        assert [t for _, t in out] == [want[(p, i % 2 == 0)] for i, (p, _) in enumerate(out)]
        wait_for(lambda: kv_empty(plain), 2.0)
        rss.append(rss_mb())
    m = plain.metrics()
    done = sum(m[f"eaglet:request_success_total{{finished_reason={r}}}"] -
               before[f"eaglet:request_success_total{{finished_reason={r}}}"] for r in ("stop", "length"))
    assert done == 400
    assert m["eaglet:request_failed_total"] == before["eaglet:request_failed_total"]
    assert m["eaglet:request_rejected_total"] == before["eaglet:request_rejected_total"]
    assert m["eaglet:time_to_first_token_seconds_count"] - before["eaglet:time_to_first_token_seconds_count"] == 400
    assert rss[1] - rss[0] < 16, f"memory grew {rss[1] - rss[0]:.1f} MB over an identical round"


def test_50_clients_drop_mid_stream(plain):
    m0 = plain.metrics()

    async def drop_after_first_tokens(client: httpx.AsyncClient, i: int):
        body = {"model": "tiny", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 200, "temperature": 0,
                "ignore_eos": True, "stream": True}
        async with client.stream("POST", plain.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= 2:
                    return  # leaving the block closes the connection mid-stream

    async def go():
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=100)) as client:
            await asyncio.gather(*(drop_after_first_tokens(client, i) for i in range(50)))

    t0 = time.perf_counter()
    asyncio.run(go())
    freed = wait_for(lambda: kv_empty(plain), 2.0)
    m = plain.metrics()
    assert m["eaglet:request_aborted_total"] - m0["eaglet:request_aborted_total"] == 50
    made = m["eaglet:generation_tokens_total"] - m0["eaglet:generation_tokens_total"]
    print(f"50 dropped streams: KV free count back to total {freed:.2f} s after the last drop "
          f"({time.perf_counter() - t0:.2f} s in all); {made:.0f} tokens generated of 50 x 200 asked")
    assert made < 50 * 200 / 4  # the rows stopped when their clients left, not at their budgets
    r = plain.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1


# ---- bad requests -------------------------------------------------------------------------------

CHAT, COMP = "/v1/chat/completions", "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]
BAD = [  # (what, method, path, body (str: raw), status, param)
    ("malformed JSON", "POST", CHAT, '{"model": "tiny", "messages": [', 400, None),
    ("body is not an object", "POST", CHAT, "[1, 2]", 400, None),
    ("missing model", "POST", CHAT, {"messages": MSGS}, 400, "model"),
    ("unknown model", "POST", CHAT, {"model": "gpt-9", "messages": MSGS}, 404, "model"),
    ("missing messages", "POST", CHAT, {"model": "tiny"}, 400, "messages"),
    ("empty messages", "POST", CHAT, {"model": "tiny", "messages": []}, 400, "messages"),
    ("messages not a list", "POST", CHAT, {"model": "tiny", "messages": "hi"}, 400, "messages"),
    ("unknown role", "POST", CHAT, {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages.[0].role"),
    ("content a number", "POST", CHAT, {"model": "tiny", "messages": [{"role": "user", "content": 5}]}, 400,
     "messages.[0].content"),
    ("content part not text", "POST", CHAT, {"model": "tiny", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages.[0].content"),
    ("temperature < 0", "POST", CHAT, {"model": "tiny", "messages": MSGS, "temperature": -0.5}, 400, "temperature"),
    ("temperature a string", "POST", CHAT, {"model": "tiny", "messages": MSGS, "temperature": "hot"}, 400,
     "temperature"),
    ("top_p 0", "POST", CHAT, {"model": "tiny", "messages": MSGS, "top_p": 0}, 400, "top_p"),
    ("top_p > 1", "POST", COMP, {"model": "tiny", "prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("temperature Infinity", "POST", COMP, '{"model": "tiny", "prompt": "x", "temperature": Infinity}', 400,
     "temperature"),
    ("seed out of range", "POST", COMP, {"model": "tiny", "prompt": "x", "seed": 2**70}, 400, "seed"),
    ("n > 1", "POST", CHAT, {"model": "tiny", "messages": MSGS, "n": 2}, 400, "n"),
    ("max_tokens 0", "POST", CHAT, {"model": "tiny", "messages": MSGS, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens a string", "POST", COMP, {"model": "tiny", "prompt": "x", "max_tokens": "10"}, 400, "max_tokens"),
    ("max_tokens beyond the context", "POST", CHAT, {"model": "tiny", "messages": MSGS, "max_tokens": 1000}, 400,
     "max_tokens"),
    ("prompt longer than the context", "POST", COMP, {"model": "tiny", "prompt": "the quick brown fox " * 200}, 400,
     "prompt"),
    ("chat longer than the context", "POST", CHAT, {"model": "tiny", "messages": [
        {"role": "user", "content": "the quick brown fox " * 200}]}, 400, "messages"),
    ("missing prompt", "POST", COMP, {"model": "tiny"}, 400, "prompt"),
    ("empty prompt", "POST", COMP, {"model": "tiny", "prompt": ""}, 400, "prompt"),
    ("several prompts", "POST", COMP, {"model": "tiny", "prompt": ["a", "b"]}, 400, "prompt"),
    ("token id outside the vocabulary", "POST", COMP, {"model": "tiny", "prompt": [5, 100000]}, 400, "prompt"),
    ("stream not a bool", "POST", CHAT, {"model": "tiny", "messages": MSGS, "stream": "yes"}, 400, "stream"),
    ("stop a number", "POST", CHAT, {"model": "tiny", "messages": MSGS, "stop": 5}, 400, "stop"),
    ("logprobs", "POST", CHAT, {"model": "tiny", "messages": MSGS, "logprobs": True}, 400, "logprobs"),
    ("echo", "POST", COMP, {"model": "tiny", "prompt": "x", "echo": True}, 400, "echo"),
    ("GET on a POST route", "GET", CHAT, None, 405, None),
    ("unknown path", "POST", "/v1/nothing", {}, 404, None),
]


@pytest.mark.parametrize("what,method,path,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_request(plain, what, method, path, body, status, param):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, str) else (
        {"json": body} if body is not None else {})
    r = httpx.request(method, plain.url + path, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
    if status == 404 and param == "model":
        assert err["code"] == "model_not_found"
    assert httpx.get(plain.url + "/health").status_code == 200


def test_bad_requests_through_the_client(plain):
    c = plain.client()
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="nope", messages=MSGS)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=MSGS, temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="tiny", prompt="x", n=3)


# ---- overload, internal failures, a dead engine -------------------------------------------------

def test_full_queue_is_429(tiny, monkeypatch):
    gate = threading.Event()

    class Gated(batcher_mod.Batcher):
        def step(self):
            gate.wait(10)
            return super().step()

    monkeypatch.setattr(engine_mod, "Batcher", Gated)
    body = {"model": "tiny", "prompt": "the quick", "max_tokens": 4, "temperature": 0}
    with LiveServer(Generator(tiny.model, tiny.tokenizer), max_batch=1, max_queue=1) as srv:
        async def go():
            async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
                first = asyncio.ensure_future(c.post("/v1/completions", json=body))  # takes the one row
                await asyncio.sleep(0.3)
                second = asyncio.ensure_future(c.post("/v1/completions", json=body))  # waits in the queue
                await asyncio.sleep(0.3)
                third = await c.post("/v1/completions", json=body)  # no room
                gate.set()
                return await first, await second, third

        a, b, full = asyncio.run(go())
        assert a.status_code == b.status_code == 200
        assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
        assert srv.metrics()["eaglet:request_rejected_total"] == 1
        assert httpx.get(srv.url + "/health").status_code == 200


def test_non_streaming_client_that_leaves_is_cancelled(tiny, monkeypatch):
    gate = threading.Event()

    class Gated(batcher_mod.Batcher):
        def step(self):
            gate.wait(10)
            return super().step()

    monkeypatch.setattr(engine_mod, "Batcher", Gated)
    with LiveServer(Generator(tiny.model, tiny.tokenizer), max_batch=2) as srv:
        body = {"model": "tiny", "prompt": "the quick", "max_tokens": 200, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/completions", json=body, timeout=0.5)  # gives up while the row is held
        gate.set()
        wait_for(lambda: kv_empty(srv), 2.0)
        m = srv.metrics()
        assert m["eaglet:request_aborted_total"] == 1 and m["eaglet:generation_tokens_total"] < 20


def test_internal_failure_fails_only_its_request(tiny, plain, monkeypatch, caplog):
    poison = 77  # a prompt ending in this token id breaks while its output is handled
    push = batcher_mod.Sequence.push

    def failing_push(self, tokens):
        if self.request.prompt[-1] == poison:
            raise RuntimeError("injected")
        return push(self, tokens)

    monkeypatch.setattr(batcher_mod.Sequence, "push", failing_push)
    failed = plain.metrics()["eaglet:request_failed_total"]

    async def go():
        async with httpx.AsyncClient(base_url=plain.url, timeout=30) as c:
            bad = {"model": "tiny", "prompt": [5, 6, poison], "max_tokens": 8, "temperature": 0}
            good = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0}
            return await asyncio.gather(c.post("/v1/completions", json=bad), c.post("/v1/completions", json=good),
                                        c.post("/v1/completions", json={**bad, "stream": True}))

    bad, good, bad_stream = asyncio.run(go())
    assert bad.status_code == 500 and bad.json()["error"]["type"] == "internal_error"
    assert "injected" in bad.json()["error"]["message"]
    assert good.status_code == 200 and good.json()["choices"][0]["text"] == reference(tiny, None, PROMPTS[1], 8, False)
    events = [line[6:] for line in bad_stream.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[-2])["error"]["type"] == "internal_error" and events[-1] == "[DONE]"
    assert "injected" in caplog.text  # logged
    assert plain.metrics()["eaglet:request_failed_total"] == failed + 2
    wait_for(lambda: kv_empty(plain), 2.0)
    assert httpx.get(plain.url + "/health").status_code == 200


def test_a_batch_that_cannot_start_fails_only_its_requests(tiny, monkeypatch):
    class NoMemory(batcher_mod.Batcher):
        def __init__(self, generator, rows, max_len, sampling):
            if not sampling.greedy:
                raise MemoryError("no room for the cache")
            super().__init__(generator, rows, max_len, sampling)

    monkeypatch.setattr(engine_mod, "Batcher", NoMemory)
    with LiveServer(Generator(tiny.model, tiny.tokenizer)) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "temperature": 0.5})
        assert r.status_code == 500 and "no room" in r.json()["error"]["message"]
        r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "temperature": 0})
        assert r.status_code == 200 and httpx.get(srv.url + "/health").status_code == 200


def test_dead_engine_is_503(tiny, monkeypatch):
    def broken(self):
        raise RuntimeError("engine bug")

    monkeypatch.setattr(engine_mod.Engine, "_take", broken)
    with LiveServer(Generator(tiny.model, tiny.tokenizer)) as srv:
        assert httpx.get(srv.url + "/health").status_code == 200
        r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        h = httpx.get(srv.url + "/health")
        assert h.status_code == 503 and h.json()["error"]["code"] == "engine_dead"
        r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 503


# ---- the command --------------------------------------------------------------------------------

def test_eaglet_serve_equals_eaglet_generate(model_dir, capsys, monkeypatch):
    """`eaglet serve` in its own process; its greedy chat reply equals `eaglet generate --chat`'s."""
    monkeypatch.setenv("EAGLET_CACHE", str(model_dir.parent / "cache"))
    flags = ["--model", str(model_dir), "--device", "cpu", "--spec", "ngram", "--spec-steps", "3"]
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "eaglet", "serve", *flags, "--port", str(port),
                             "--served-model-name", "tiny", "--max-batch", "4"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        prompt = "the quick brown fox"
        rc = main(["generate", "--chat", prompt, "--max-new-tokens", "20", *flags])
        want = capsys.readouterr().out[:-1]  # the text, then a newline
        assert rc == 0

        def up():
            assert proc.poll() is None, proc.stdout.read()
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
            except httpx.TransportError:
                return False
        wait_for(up, 60)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=20,
                                      temperature=0)
        assert r.choices[0].message.content == want
        assert r.usage.accept_length is not None
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out


def test_serve_flags_are_checked(capsys):
    assert main(["serve", "--max-batch", "0"]) == 1
    assert "--max-batch" in capsys.readouterr().err


# ---- the speculation policy ---------------------------------------------------------------------

# An `eaglet profile` record's results, made up so that the planner speculates (chain:2) at batch 1
# and decodes plain at batch 4: verifying costs nothing extra alone and a lot in a batch of 4.
POLICY_PROFILE = {
    "costs": [{"batch": 1, "context": 64, "decode_ms": 10.0, "verify_ms": {"1": 10.0, "2": 10.0, "3": 10.0},
               "draft_ms": {"1": 0.5}},
              {"batch": 4, "context": 64, "decode_ms": 10.0, "verify_ms": {"1": 10.0, "2": 30.0, "3": 40.0},
               "draft_ms": {"1": 2.0}}],
    "acceptance": {"chain": {"steps": 2, "accept_per_pos": [0.8, 0.6], "accept_length": 2.4, "drafts": 100,
                             "step_ms_measured": 11.0}, "trees": {}},
    "acceptance_batch": 1,
}


def write_record(path, kind: str, results: dict):
    path.write_text(json.dumps({"kind": kind, "flags": {"spec": "eagle3"}, "environment": {}, "models": {},
                                "results": results}))
    return path


@pytest.fixture
def policy_record(tmp_path):
    return write_record(tmp_path / "profile.json", "profile", POLICY_PROFILE)


def serve_app(monkeypatch, flags: list[str]):
    """What `eaglet serve FLAGS` would hand to uvicorn.run: its app."""
    apps = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: apps.append(app))
    assert main(["serve", *flags]) == 0
    return apps[0]


def gate_steps(monkeypatch, gate: threading.Event, sampled_only: bool) -> threading.Event:
    """Batches (only sampled ones, or all) hold their steps until `gate` is set; the event returned
    is set once a step is held (its requests admitted)."""
    held = threading.Event()

    class Gated(batcher_mod.Batcher):
        def step(self):
            if not (sampled_only and self.sampling.greedy):
                held.set()
                gate.wait(10)
            return super().step()

    monkeypatch.setattr(engine_mod, "Batcher", Gated)
    return held


def test_the_profile_policy(policy_record):
    table, _ = load_profile_policy(str(policy_record))
    assert table == {1: "chain:2", 4: None}
    p = SpecPolicy(Speculator(SpecConfig("ngram", steps=3)), table)
    assert [p.choose(n) for n in (1, 2, 3, 4, 5, 16)] == ["chain:2"] * 3 + [None] * 3
    assert p.speculator("chain:2").spec == SpecConfig("ngram", steps=2) and p.speculator(None) is None
    assert [SpecPolicy(p.base, table, 2).choose(n) for n in (1, 2, 3)] == ["chain:2", "chain:2", None]
    assert [SpecPolicy(p.base, None, 2).choose(n) for n in (1, 2, 3)] == ["chain:3", "chain:3", None]
    assert SpecPolicy(p.base, None, 0).choose(1) is None and SpecPolicy(None).choose(1) is None
    assert [SpecPolicy(p.base, {2: "chain:1", 8: None}).choose(n) for n in (1, 7, 8)] == ["chain:1", "chain:1", None]


@pytest.mark.parametrize("mode", ["--spec-policy", "--spec-max-batch"])
def test_spec_policy_speculates_alone_and_serves_a_burst_plain(tiny, model_dir, drafter_dir, policy_record, mode,
                                                               monkeypatch, capsys, caplog):
    """`eaglet serve` with a profile's policy (chain:2 at 1, plain at 4) or --spec-max-batch 3: a
    request alone speculates; 4 greedy requests that start a batch together decode plain (their
    usage has no accept length, the speculation counters do not move); greedy text is the same."""
    flags = ["--model", str(model_dir), "--device", "cpu", "--draft", str(drafter_dir), "--max-batch", "4",
             "--served-model-name", "tiny"]
    flags += ["--spec-policy", str(policy_record)] if mode == "--spec-policy" else ["--spec-steps", "2",
                                                                                    "--spec-max-batch", "3"]
    app = serve_app(monkeypatch, flags)
    assert ("(1: chain:2, 4: plain)" if mode == "--spec-policy" else "chain:2 for batches of up to 3, plain above"
            ) in capsys.readouterr().err
    gate = threading.Event()
    held = gate_steps(monkeypatch, gate, sampled_only=True)
    caplog.set_level("INFO", logger="eaglet.server")
    want = {p: reference(tiny, None, p, 16, chat=False) for p in PROMPTS[:4]}
    with LiveServer(None, app=app) as srv:
        c = srv.client()

        def alone() -> None:
            m0 = srv.metrics()
            r = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16, temperature=0)
            assert r.choices[0].text == want[PROMPTS[0]]
            assert r.usage.accept_length is not None and r.usage.spec_decode["num_drafts"] >= 1
            m = srv.metrics()
            assert m["eaglet:spec_policy_speculating"] == 1 and m["eaglet:spec_policy_batch_size"] == 1
            assert m["eaglet:spec_policy_setting{setting=chain:2}"] == 1
            assert (m["eaglet:spec_decode_num_drafts_total"] - m0["eaglet:spec_decode_num_drafts_total"]
                    == r.usage.spec_decode["num_drafts"])

        alone()

        async def burst():
            """4 greedy requests queue behind a seeded one held in its step, then start together."""
            async with srv.async_client() as ac:
                return await burst_with(ac)

        async def burst_with(ac):
            blocker = asyncio.ensure_future(ac.completions.create(model="tiny", prompt=PROMPTS[5], max_tokens=4,
                                                                  temperature=1.0, seed=1))
            assert await asyncio.to_thread(held.wait, 10)
            reqs = [asyncio.ensure_future(ac.completions.create(model="tiny", prompt=p, max_tokens=16,
                                                                temperature=0)) for p in PROMPTS[:4]]
            await asyncio.to_thread(wait_for, lambda: srv.metrics()["eaglet:num_requests_waiting"] == 4, 10)
            m0 = srv.metrics()
            gate.set()
            return m0, await blocker, await asyncio.gather(*reqs)

        m0, blocker, rs = asyncio.run(burst())
        assert [r.choices[0].text for r in rs] == [want[p] for p in PROMPTS[:4]]
        assert all(r.usage.accept_length is None and r.usage.spec_decode is None for r in rs)
        assert blocker.usage.accept_length is not None  # alone (seeded): speculated
        m = srv.metrics()
        assert (m["eaglet:spec_decode_num_drafts_total"] - m0["eaglet:spec_decode_num_drafts_total"]
                == blocker.usage.spec_decode["num_drafts"])  # the burst drafted nothing
        assert m["eaglet:spec_policy_speculating"] == 0 and m["eaglet:spec_policy_batch_size"] == 4
        assert m["eaglet:spec_policy_setting{setting=plain}"] == 1
        assert m["eaglet:spec_policy_setting{setting=chain:2}"] == 0
        alone()  # the next request alone speculates again
    assert "a batch of 4 requests starts plain (was chain:2)" in caplog.text
    assert "a batch of 1 request starts speculating with chain:2 (was plain)" in caplog.text


def test_a_speculating_batch_that_grows_drains_to_plain(tiny, drafter_dir, policy_record, monkeypatch, caplog):
    """One request starts a speculating batch; 4 more arrive (load 4: plain): the batch takes no more,
    finishes its request speculatively, and the 4 start a plain batch."""
    sp = speculator(tiny, drafter_dir, "eagle3")  # chain:3; the policy picks chain:2 at 1
    table, _ = load_profile_policy(str(policy_record))
    gate = threading.Event()
    held = gate_steps(monkeypatch, gate, sampled_only=False)
    caplog.set_level("INFO", logger="eaglet.server")
    want = {p: reference(tiny, None, p, 12, chat=False) for p in PROMPTS[:5]}
    with LiveServer(Generator(tiny.model, tiny.tokenizer, sp), max_batch=4,
                    policy=SpecPolicy(sp, table, None, "profile.json")) as srv:
        async def go():
            async with srv.async_client() as ac:
                return await go_with(ac)

        async def go_with(ac):
            def send(p):
                return asyncio.ensure_future(ac.completions.create(model="tiny", prompt=p, max_tokens=12,
                                                                   temperature=0))
            first = send(PROMPTS[4])
            assert await asyncio.to_thread(held.wait, 10)
            rest = [send(p) for p in PROMPTS[:4]]
            await asyncio.to_thread(wait_for, lambda: srv.metrics()["eaglet:num_requests_waiting"] == 4, 10)
            gate.set()
            return await first, await asyncio.gather(*rest)

        first, rest = asyncio.run(go())
        assert first.choices[0].text == want[PROMPTS[4]] and first.usage.accept_length is not None
        assert [r.choices[0].text for r in rest] == [want[p] for p in PROMPTS[:4]]
        assert all(r.usage.accept_length is None for r in rest)
        m = srv.metrics()
        assert m["eaglet:spec_policy_speculating"] == 0 and m["eaglet:spec_policy_batch_size"] == 4
        assert set(srv.engine.generators) == {"chain:2", "chain:3", None}  # chain:3: the given one
    assert "the speculating batch (chain:2) would grow to 4 requests" in caplog.text
    assert "a batch of 4 requests starts plain (was chain:2)" in caplog.text


@pytest.mark.parametrize("case", ["missing", "not json", "not a profile", "no costs", "no drafter", "negative cap"])
def test_spec_policy_flags_are_checked(tmp_path, case, capsys):
    """Each mistake is one `eaglet: error:` line, before any model is loaded."""
    path = {"missing": tmp_path / "nope.json",
            "not json": tmp_path / "bad.json",
            "not a profile": write_record(tmp_path / "bench.json", "bench", {"tok_s": 1.0}),
            "no costs": write_record(tmp_path / "p.json", "profile", {"acceptance": {}}),
            }.get(case, write_record(tmp_path / "ok.json", "profile", POLICY_PROFILE))
    if case == "not json":
        path.write_text("{not json")
    flags = ["serve", "--model", str(tmp_path / "no-model"), "--spec", "none" if case == "no drafter" else "ngram",
             "--spec-policy", str(path)] + (["--spec-max-batch", "-1"] if case == "negative cap" else [])
    assert main(flags) == 1
    err = capsys.readouterr().err
    assert err.startswith("eaglet: error: ") and err.count("\n") == 1, err
    assert {"missing": "does not exist", "not json": "not JSON", "not a profile": "not a profile record",
            "no costs": "without the costs and acceptance", "no drafter": "none is configured",
            "negative cap": "--spec-max-batch must be >= 0"}[case] in err
