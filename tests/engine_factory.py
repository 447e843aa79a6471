"""Engines built in an engine process (server/remote.py's factories): module-level functions the
spawned child imports, so this module imports nothing of the test suite's (conftest imports
serving.py, which imports conftest)."""
from __future__ import annotations

import torch

from eaglet.config import SpecConfig
from eaglet.errors import ModelLoadError
from eaglet.generate import Generator
from eaglet.server.engine import Engine
from eaglet.spec.speculator import load_speculator
from eaglet.weights import load_model


def tiny_engine(model_dir, drafter_dir, kind: str, max_batch: int = 4) -> Engine:
    """The tiny model's engine, plain or with its random EAGLE-3 drafter (serving.speculator's)."""
    torch.set_num_threads(1)
    tiny = load_model(model_dir, dtype="float32", device="cpu")
    sp = None if kind == "plain" else load_speculator(SpecConfig("eagle3", draft=str(drafter_dir), steps=3),
                                                      tiny.model, tiny.path)
    return Engine.serving(Generator(tiny.model, tiny.tokenizer, sp), "tiny", max_batch=max_batch)


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
