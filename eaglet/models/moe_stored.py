"""Routed experts kept as a quantized release stores them, for the fused kernels to read as they are
(models/fused_moe.py): Kimi-K2.5's compressed-tensors INT4 packs (a quarter of bfloat16's bytes) and
DeepSeek-V3's / Kimi-K2's FP8 with a scale per block (half). Everything else in the checkpoint
(attention, shared experts, router, embeddings) is dequantized on the way in, as before.

Each routed expert's gate / up / down becomes a `StoredLinear` whose buffers carry the checkpoint's
names (`weight_packed`, `weight_scale`, `weight_shape`; or `weight`, `weight_scale_inv`), so the
name-checked loader fills them unchanged; `stack` then joins them into one Int4 or Fp8Block stack
per projection, each expert's buffers becoming views of it. Where the device has no fused MoE
kernels the loader dequantizes instead (weights/loader.py).
"""
from __future__ import annotations

import re

import torch
from torch import nn

from ..errors import ModelLoadError
from .fused_moe import Fp8Block, Int4

ROUTED = re.compile(r"\.experts\.\d+\.")  # a routed expert's tensor (not the shared experts')


def storable(method: str, args: dict) -> tuple[str, int] | None:
    """What the fused kernels read of a quantization scheme (weights/quant.py's `scheme`): ("int4",
    group), ("fp8", block), or None (dequantized at load)."""
    if method == "packed" and args["bits"] == 4 and args["group"] % 8 == 0:
        return "int4", args["group"]
    if method == "fp8" and args["block"][0] == args["block"][1]:
        return "fp8", args["block"][0]
    return None


class StoredLinear(nn.Module):
    """A linear layer's weight (out_features, in_features) as stored: INT4 packs or FP8 blocks."""

    def __init__(self, in_features: int, out_features: int, stored: tuple[str, int]):
        super().__init__()
        self.shape, self.stored = (out_features, in_features), stored
        for name, t in self.empty("meta").items():
            self.register_buffer(name, t)

    def empty(self, device) -> dict[str, torch.Tensor]:
        (out, inp), (kind, n) = self.shape, self.stored
        if kind == "int4":
            return {"weight_packed": torch.empty(out, -(-inp // 8), dtype=torch.int32, device=device),
                    "weight_scale": torch.empty(out, -(-inp // n), dtype=torch.bfloat16, device=device),
                    "weight_shape": torch.empty(2, dtype=torch.int64, device=device)}
        return {"weight": torch.empty(out, inp, dtype=torch.float8_e4m3fn, device=device),
                "weight_scale_inv": torch.empty(-(-out // n), -(-inp // n), dtype=torch.float32, device=device)}

    def reset_dtypes(self) -> None:
        """The stored dtypes again after the model was cast to its dtype (which casts float buffers)."""
        device = next(iter(self.buffers())).device
        for name, t in self.empty(device).items():
            setattr(self, name, t)


def stack(experts, stored: tuple[str, int]) -> tuple[Int4 | Fp8Block, Int4 | Fp8Block]:
    """(gate_up, down) stacks of the experts' StoredLinears (gate and up joined along the rows), each
    expert's buffers made views of them."""
    kind, n = stored
    parts = ("weight_packed", "weight_scale") if kind == "int4" else ("weight", "weight_scale_inv")
    lins = [e.linears() for e in experts]
    width = lins[0][0].shape[0]
    if kind == "int4":  # load time: the packs' own record of their shapes
        bad = next((lin for trio in lins for lin in trio if tuple(lin.weight_shape.tolist()) != lin.shape), None)
        if bad is not None:
            raise ModelLoadError(f"an INT4 expert weight records shape {tuple(bad.weight_shape.tolist())}, "
                             f"its layer is {bad.shape}")
    if kind == "fp8" and width % n:
        raise ModelLoadError(f"FP8 experts of width {width} do not fill whole {n}-row scale blocks")
    split = {"weight_packed": width, "weight_scale": width, "weight": width, "weight_scale_inv": width // n}
    gate_up = {p: torch.stack([torch.cat([g.get_buffer(p), u.get_buffer(p)]) for g, u, _ in lins]) for p in parts}
    down = {p: torch.stack([d.get_buffer(p) for _, _, d in lins]) for p in parts}
    for i, (g, u, d) in enumerate(lins):
        for p in parts:
            setattr(g, p, gate_up[p][i, :split[p]])
            setattr(u, p, gate_up[p][i, split[p]:])
            setattr(d, p, down[p][i])
    make = (lambda s: Int4(s["weight_packed"], s["weight_scale"], n)) if kind == "int4" else \
        (lambda s: Fp8Block(s["weight"], s["weight_scale_inv"], n))
    return make(gate_up), make(down)
