"""Quantized checkpoints, dequantized as they stream in (`dequantized`), from config.json's
`quantization_config`:

- `fp8` (DeepSeek-V3, Kimi-K2): `X.weight` in float8_e4m3fn with `X.weight_scale_inv`, one float32
  scale per `weight_block_size` block (128 x 128): weight = fp8 value x its block's scale.
- `compressed-tensors`, format `pack-quantized` (Kimi-K2-Thinking, Kimi-K2.5): `X.weight_packed`
  (int32, 32 / num_bits values each, column c*k + i in bits i*num_bits of packed column c, stored
  with an offset of 2^(num_bits-1)), `X.weight_scale` (one scale per row and group of columns) and
  `X.weight_shape`: weight = (value - offset) x its group's scale (symmetric, no zero point).

Tensors that are not quantized (norms, embeddings, the router) pass through. A quantized weight's
parts may sit in different shards, so each is held until its partners arrive. Anything else (an
unknown method or format, a scale of the wrong shape, a part without its partners) is one error
naming it.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator

import torch

from ..errors import ModelLoadError

FP8_PARTS = ("weight", "weight_scale_inv")
PACKED_PARTS = ("weight_packed", "weight_scale", "weight_shape")


def scheme(quant: dict | None) -> tuple[str, dict] | None:
    """(method, its settings) from a `quantization_config`, or None for an unquantized checkpoint."""
    if not quant:
        return None
    method = quant.get("quant_method")
    if method == "fp8":
        if quant.get("fmt", "e4m3") != "e4m3":
            raise ModelLoadError(f"quantization_config: fp8 format {quant.get('fmt')!r} is not supported (e4m3)")
        block = quant.get("weight_block_size")
        if not block or len(block) != 2:
            raise ModelLoadError("quantization_config: fp8 without weight_block_size (per-tensor fp8 is not "
                                 "supported; block-quantized checkpoints carry [128, 128])")
        return "fp8", {"block": tuple(int(b) for b in block)}
    if method == "compressed-tensors":
        if quant.get("format") != "pack-quantized":
            raise ModelLoadError(f"quantization_config: compressed-tensors format {quant.get('format')!r} is not "
                                 f"supported (pack-quantized)")
        groups = list((quant.get("config_groups") or {}).values())
        weights = [g.get("weights") or {} for g in groups]
        if len({(w.get("num_bits"), w.get("group_size")) for w in weights}) != 1:
            raise ModelLoadError("quantization_config: compressed-tensors with several weight schemes is not supported")
        w = weights[0]
        if not w.get("symmetric", False) or w.get("strategy") != "group" or w.get("type", "int") != "int":
            raise ModelLoadError(f"quantization_config: compressed-tensors weights {w} are not supported "
                                 f"(symmetric int, group strategy)")
        return "packed", {"bits": int(w["num_bits"]), "group": int(w["group_size"])}
    raise ModelLoadError(f"quantization_config.quant_method {method!r} is not supported (supported: fp8 with "
                         f"weight_block_size, compressed-tensors pack-quantized)")


def dequantized(pairs: Iterable[tuple[str, torch.Tensor]], quant: dict | None,
                keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs with every quantized weight replaced by its float32 dequantization, except
    those whose names `keep` accepts: their parts pass as stored (routed experts the fused kernels
    read packed)."""
    s = scheme(quant)
    if s is None:
        yield from pairs
        return
    method, args = s
    parts = FP8_PARTS if method == "fp8" else PACKED_PARTS
    held: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in pairs:
        base, _, part = name.rpartition(".")
        if (part not in parts or (method == "fp8" and part == "weight" and t.dtype != torch.float8_e4m3fn)
                or (keep is not None and keep(name))):
            yield name, t
            continue
        got = held.setdefault(base, {})
        got[part] = t
        if len(got) == len(parts):
            del held[base]
            w = fp8_block(base, *(got[p] for p in parts), args["block"]) if method == "fp8" else \
                unpack(base, *(got[p] for p in parts), args["bits"], args["group"])
            yield base + ".weight", w
    if held:
        base, got = next(iter(held.items()))
        missing = [p for p in parts if p not in got]
        raise ModelLoadError(f"quantized tensor {base + '.' + missing[0]!r} is missing (its "
                             f"{', '.join(sorted(got))} arrived)")


def fp8_block(base: str, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float8 weight (out, in) x one scale per block (ceil(out/b0), ceil(in/b1)) -> float32."""
    rows, cols = w.shape
    want = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    if tuple(scale.shape) != want:
        raise ModelLoadError(f"tensor {base + '.weight_scale_inv'!r} has shape {tuple(scale.shape)}, a {rows} x "
                             f"{cols} weight in {block[0]} x {block[1]} blocks needs {want}")
    s = scale.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return w.float() * s


def unpack(base: str, packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor, bits: int,
           group: int) -> torch.Tensor:
    """int32-packed signed `bits`-bit values with one scale per row and group -> float32 (rows, cols)."""
    rows, cols = (int(x) for x in shape.tolist())
    per = 32 // bits
    if packed.dtype != torch.int32 or tuple(packed.shape) != (rows, math.ceil(cols / per)):
        raise ModelLoadError(f"tensor {base + '.weight_packed'!r} is {packed.dtype} {tuple(packed.shape)}, a "
                             f"{rows} x {cols} weight packs into int32 ({rows}, {math.ceil(cols / per)})")
    if tuple(scale.shape) != (rows, math.ceil(cols / group)):
        raise ModelLoadError(f"tensor {base + '.weight_scale'!r} has shape {tuple(scale.shape)}, a {rows} x {cols} "
                             f"weight in groups of {group} needs ({rows}, {math.ceil(cols / group)})")
    shifts = torch.arange(per, dtype=torch.int32, device=packed.device) * bits
    values = (packed[..., None] >> shifts) & ((1 << bits) - 1)  # (rows, packed cols, per)
    q = values.reshape(rows, -1)[:, :cols].float() - (1 << (bits - 1))
    return q * scale.float().repeat_interleave(group, 1)[:, :cols]
