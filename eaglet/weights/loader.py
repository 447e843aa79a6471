"""Build a model from a path: a HF directory or a GGUF file (converted once, then cached).

The model is built on the meta device, materialised on the target device and dtype, and filled
from a stream of (name, tensor) pairs: a name the model does not have, a missing parameter or a
shape mismatch is a ModelLoadError naming the tensor. Quantized checkpoints (FP8 blocks,
compressed-tensors INT4 packs) are dequantized on the way in (quant.py), except an MoE model's
routed experts where the device runs the fused MoE kernels: those stay as stored and the kernels
read them so (models/moe_stored.py).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ModelConfig, text_config
from ..default_model import default_model_path
from ..errors import ModelLoadError
from ..kernels import Kernels
from ..models import moe_stored
from ..models.llama import CausalLM, compile_elementwise
from ..tokenizer import Tokenizer
from . import quant, safetensors_dir
from .gguf_cache import converted_dir
from .gguf_file import is_gguf
from .names import IGNORED

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
OPTIONAL = {"model.rotary.freq_factors"}  # buffers with a correct default when absent


@dataclass
class LoadedModel:
    model: CausalLM
    tokenizer: Tokenizer | None
    config: ModelConfig
    path: Path  # what the user named
    weights_dir: Path  # the HF directory the weights came from (the cache entry for GGUF)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    return DTYPES[dtype]


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ModelLoadError(f"unknown device {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda was asked for but no CUDA GPU is available")
    return dev


def load_state(model: torch.nn.Module, pairs: Iterable[tuple[str, torch.Tensor]], source: str = "",
               optional: set[str] = OPTIONAL) -> None:
    """Copy (name, tensor) pairs into `model`, casting to each parameter's dtype. Every state-dict
    entry not in `optional` must arrive; a name the model lacks or a wrong shape is an error."""
    targets = model.state_dict(keep_vars=True)  # tied weights appear under both names
    aliases = {n: {m for m, q in targets.items() if q is p} for n, p in targets.items()}
    missing = set(targets) - optional
    prefix = f"{source}: " if source else ""
    for name, tensor in pairs:
        if IGNORED.search(name):
            continue
        if name not in targets:
            raise ModelLoadError(f"{prefix}unexpected tensor {name!r} (the model has no such parameter)")
        dst = targets[name]
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ModelLoadError(f"{prefix}tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(dst.shape)}")
        with torch.no_grad():
            dst.copy_(tensor)
        missing -= aliases[name]
    if missing:
        raise ModelLoadError(f"{prefix}missing tensor {sorted(missing)[0]!r}"
                             + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))


def build_model(config: ModelConfig, pairs, device: torch.device, dtype: torch.dtype, source: str = "",
                kernels: Kernels | None = None) -> CausalLM:
    """The model filled from `pairs`, running `kernels` (default: Kernels.choose for the device)."""
    kernels = Kernels.choose(device) if kernels is None else kernels
    with torch.device("meta"):
        model = CausalLM(config, kernels)
    model = model.to_empty(device=device).to(dtype)
    model.post_materialize()
    load_state(model, pairs, source)
    model.fuse_projections()
    if kernels.compile:
        compile_elementwise(model)
    return model.eval().requires_grad_(False)


def load_model(path: str | Path | None = None, dtype: str | torch.dtype | None = None,
               device: str | torch.device | None = None, tokenizer: bool = True,
               kernels: Kernels | None = None, tp=None) -> LoadedModel:
    """Load a Llama-family model from a HF directory or a GGUF file (None: the embedded default),
    running `kernels` (eaglet/kernels.py; default: the best the device has). With `tp` (dist/tp.py's
    TP: this rank of several), this rank's slice of a tensor-parallel model, its outputs summed over
    the ranks of the default process group."""
    path = Path(path) if path is not None else default_model_path()
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist")
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if is_gguf(path):
        weights_dir = converted_dir(path)
    elif path.is_dir():
        weights_dir = path
    else:
        raise ModelLoadError(f"{path}: neither a HF model directory nor a GGUF file")
    hf = safetensors_dir.read_config(weights_dir)
    config = ModelConfig.from_hf(hf)
    quantized = hf.get("quantization_config") or text_config(hf).get("quantization_config")
    method = quant.scheme(quantized)  # an unsupported one refused before the model is built
    kernels = Kernels.choose(dev) if kernels is None else kernels
    keep = None
    # split over ranks by width, routed experts are dequantized; whole (one rank, or EP) they stay as stored
    whole = tp is None or tp.world == 1 or tp.moe == "ep"
    if method and config.moe is not None and kernels.moe and whole and (stored := moe_stored.storable(*method)):
        # routed experts stay as stored: the fused kernels read them packed (a quarter or half the bytes)
        config = config.replace(moe=dataclasses.replace(config.moe, stored=stored))
        keep = lambda name: moe_stored.ROUTED.search(name) is not None  # noqa: E731
    pairs = safetensors_dir.iter_tensors(weights_dir)
    if isinstance(hf.get("text_config"), dict) and hf.get("model_type") != config.model_type:  # a wrapper
        pairs = safetensors_dir.text_tensors(pairs)
    pairs = quant.dequantized(pairs, quantized, keep)
    if tp is not None and tp.world > 1:
        from ..dist import tp as tensor_parallel

        pairs = tensor_parallel.shard_pairs(pairs, config, tp)
        config = tensor_parallel.local_config(config, tp)
    model = build_model(config, pairs, dev, dt, source=str(path), kernels=kernels)
    if tp is not None and tp.world > 1:
        tensor_parallel.all_reduce_outputs(model)
    tok = Tokenizer.from_dir(weights_dir, config) if tokenizer else None
    return LoadedModel(model=model, tokenizer=tok, config=config, path=path, weights_dir=weights_dir)
