"""Engines built in an engine process (server/remote.py's factories): module-level functions the
spawned child imports, so this module imports nothing of the test suite's (conftest imports
serving.py, which imports conftest)."""
from __future__ import annotations

import torch

from eaglet.config import SpecConfig
from eaglet.errors import ModelLoadError
from eaglet.generate import Generator
from eaglet.server.app import make_engine
from eaglet.server.engine import Engine
from eaglet.spec.speculator import load_speculator
from eaglet.weights import load_model


def speculator(tiny, drafter_dir, kind: str):
    """The server tests' speculators of the tiny model: plain (None), ngram or its random EAGLE-3 drafter."""
    if kind == "plain":
        return None
    spec = SpecConfig("eagle3", draft=str(drafter_dir), steps=3) if kind == "eagle3" else SpecConfig("ngram", steps=3)
    return load_speculator(spec, tiny.model, tiny.path)


def tiny_engine(model_dir, drafter_dir, kind: str, max_batch: int = 4) -> Engine:
    """The tiny model's engine with speculator(kind)."""
    torch.set_num_threads(1)
    tiny = load_model(model_dir, dtype="float32", device="cpu")
    return make_engine(Generator(tiny.model, tiny.tokenizer, speculator(tiny, drafter_dir, kind)), "tiny",
                       max_batch=max_batch)


def failing_engine(message: str) -> Engine:
    raise ModelLoadError(message)


def step_failing_engine(model_dir) -> Engine:
    """The tiny model's engine whose every decoding step raises (after the admission's first tokens)."""
    from eaglet.server import engine as engine_mod

    class Failing(engine_mod.Batcher):
        def step(self, trip=None):
            raise RuntimeError("step bug")

    engine_mod.Batcher = Failing
    return tiny_engine(model_dir, None, "plain")
