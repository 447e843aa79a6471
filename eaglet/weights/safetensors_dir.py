"""A HF model directory: config.json plus model.safetensors, sharded safetensors with their index,
or pytorch_model.bin. Yields (name, tensor) pairs lazily, one shard open at a time."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import ModelLoadError


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (path / s).exists()]
        if missing:
            raise ModelLoadError(f"{path}: shard {missing[0]} named in model.safetensors.index.json is missing")
        return [path / s for s in shards]
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (path / name).exists():
            return [path / name]
    found = sorted(path.glob("*.safetensors"))
    if found:
        return found
    raise ModelLoadError(f"{path}: no model.safetensors, sharded index or pytorch_model.bin")


def iter_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for f in weight_files(path):
        if f.suffix == ".bin":
            state = torch.load(f, map_location="cpu", weights_only=True)
            yield from state.items()
            continue
        try:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():
                    yield name, sf.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise ModelLoadError(f"{f}: cannot read safetensors file ({e})") from None


TEXT_PREFIX = "language_model."  # a multimodal wrapper's language model (Kimi-K2.5, Kimi-VL)


def text_tensors(pairs: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A multimodal wrapper's checkpoint as its language model's: `language_model.` names without
    the prefix; the other towers' tensors (vision, projector) left out."""
    for name, t in pairs:
        if name.startswith(TEXT_PREFIX):
            yield name[len(TEXT_PREFIX):], t


def read_config(path: Path) -> dict:
    cfg = path / "config.json"
    if not cfg.exists():
        raise ModelLoadError(f"{path}: no config.json (expected a HF model directory or a .gguf file)")
    try:
        return json.loads(cfg.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{cfg}: not valid JSON ({e})") from None
