"""What the server tests share: a live uvicorn server on 127.0.0.1 around build_app, metric
scraping, and module fixtures (a tiny model with a chat template, a random EAGLE-3 drafter, a
plain server)."""
from __future__ import annotations

import shutil
import socket
import threading
import time

import httpx
import openai
import pytest
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from eaglet.config import ModelConfig
from eaglet.generate import GenerationConfig, Generator
from eaglet.server import batcher as batcher_mod
from eaglet.server import engine as engine_mod
from eaglet.server.app import build_app
from eaglet.spec.drafters.eagle3_ckpt import save_eagle3
from eaglet.spec.drafters.eagle3_head import Eagle3Config
from eaglet.weights import load_model

from .conftest import make_tiny_tokenizer
from .engine_factory import speculator  # noqa: F401 (the server tests' speculators)
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


@pytest.fixture(scope="module")
def plain(tiny):
    with LiveServer(Generator(tiny.model, tiny.tokenizer), max_batch=16, max_queue=64) as srv:
        yield srv


def reference(tiny, sp, prompt: str, max_tokens: int, chat: bool, stop=()) -> str:
    tok = tiny.tokenizer
    ids = tok.apply_chat([{"role": "user", "content": prompt}]) if chat else tok.encode(prompt)
    [c] = Generator(tiny.model, tok, sp).generate([ids], GenerationConfig(max_tokens, stop=tuple(stop)))
    return c.text


def gate_steps(monkeypatch, gate: threading.Event, sampled_only: bool) -> threading.Event:
    """Steps (only those with a sampled request running, or all) are held until `gate` is set; the
    event returned is set once a step is held (its requests admitted)."""
    held = threading.Event()

    class Gated(batcher_mod.Batcher):
        def step(self, trip=None):
            sampled = any(s is not None and not s.request.sampling.greedy for s in self.rows)
            if sampled or not sampled_only:
                held.set()
                gate.wait(10)
            return super().step(trip)

    monkeypatch.setattr(engine_mod, "Batcher", Gated)
    return held
