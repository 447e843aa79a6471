"""Attention over the cache on the GPU: eaglet's Triton kernel (store + attend + layout,
models/cache_attention.py) against the general path (indexed store, additive mask, SDPA, relayout),
and the split size that suits each span. Two views, both graphed, medians of CUDA-event timings:

- per layer: 30 calls (one per layer of a cache) captured in one graph, µs per call, for SmolLM2-135M
  (3 kv heads x 3, d 64) and Llama-3.1-8B (8 x 4, d 128) head shapes, batch 1 and 16, spans 128 ..
  4096, 1 and 6 new tokens (decode, a chain-5 verify), the kernel at several split sizes and at its
  default (split_size);
- the whole model: forward_curve's step of 1, 6, 16 and 64 tokens for SmolLM2 and the 8B shape,
  kernel on and off (everything else the same).

  python3 bench/gpu/cache_attention_probe.py OUT_DIR
  python3 bench/gpu/cache_attention_probe.py OUT_DIR tiles   # batch 1, 1-64 new tokens: every tile of
      # 16-64 query rows a program and split size, per layer (is one 64-row tile why 16 tokens cost more?)
  python3 bench/gpu/cache_attention_probe.py OUT_DIR split   # batch 1, 1 and 6 new tokens, the spans a
      # decode graph takes (640-4096): every split size and the rule's, per layer, for each head shape
      # (Qwen3-30B-A3B's 4 kv heads x 8 run 4 programs a split: does the rule split its spans enough?)
"""
import dataclasses
import sys

import torch
import torch.nn.functional as F

from eaglet.kernels import Kernels
from eaglet.models import cache_attention as ca
from eaglet.models.attention import additive_bias
from eaglet.perf.curves import forward_curve, time_ms
from eaglet.perf.record import write_record
from eaglet.perf.shapes import random_model

LAYERS = 30
HEADS = {"smollm2-135m": (3, 3, 64), "llama-3.1-8b": (8, 4, 128), "qwen3-30b-a3b": (4, 8, 128)}  # kv heads, group, d
CHUNKS = (64, 128, 256, 512, 1024)


def per_call_us(fn) -> float:
    """µs per call of fn, LAYERS calls captured in one graph."""
    for _ in range(2):
        fn(0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(LAYERS):
            fn(i)
    g.replay()
    return time_ms(g.replay, torch.device("cuda"), 50) * 1e3 / LAYERS


def layer_probe(shape: str, b: int, kv_len: int, t: int) -> dict:
    hkv, g, d = HEADS[shape]
    dev, dt = "cuda", torch.bfloat16
    cache = torch.randn(LAYERS, 2, b, hkv, kv_len + 64, d, device=dev, dtype=dt)  # KVCache's layout
    qkv = torch.randn(b, t, hkv * (g + 2), d, device=dev, dtype=dt)
    start = torch.full((b,), kv_len - t, device=dev)
    slots = start[:, None] + torch.arange(t, device=dev)
    rows = torch.arange(b, device=dev)[:, None].expand(b, t)
    s = torch.arange(kv_len, device=dev)
    bias = additive_bias((s[None, :] <= slots[..., None])[:, None], g, dt)  # (B, 1, G*T, S) causal, once a step

    def general(i):  # what models/llama.py does without the kernel (RoPE's relayout included)
        q = qkv[:, :, :hkv * g].view(b, t, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * t, d)
        kv = qkv[:, :, hkv * g:].view(b, t, 2, hkv, d)
        cache[i][:, rows, :, slots] = kv  # KVCache.write
        o = F.scaled_dot_product_attention(q, cache[i, 0, :, :, :kv_len], cache[i, 1, :, :, :kv_len],
                                           attn_mask=bias)
        return o.reshape(b, hkv * g, t, d).transpose(1, 2).reshape(b, t, hkv * g * d)

    out = {"sdpa+store": per_call_us(general)}
    for chunk in CHUNKS:
        if chunk < kv_len and -(-kv_len // chunk) <= ca.MAX_SPLITS:
            out[f"triton/{chunk}"] = per_call_us(
                lambda i, c=chunk: ca.cache_attention(qkv, cache[i, 0], cache[i, 1], start, None, kv_len, g, c))
    out["triton/default"] = per_call_us(lambda i: ca.cache_attention(qkv, cache[i, 0], cache[i, 1], start, None, kv_len, g))
    out["default_split"] = ca.split_size(kv_len, b * hkv * ca.row_tiles(g, t, b * hkv)[1])
    return out


def tiles_probe(out_dir: str) -> None:
    """Per layer, batch 1: the kernel at every query-row tile (16, 32, 64 rows a program) and split
    size (the rule's, 128, 256) for 1, 6, 16 and 64 new tokens."""
    results = {}
    for shape, (hkv, g, d) in HEADS.items():
        for kv_len in (512, 2048):
            for t in (1, 6, 16, 64):
                cache = torch.randn(LAYERS, 2, 1, hkv, kv_len + 64, d, device="cuda", dtype=torch.bfloat16)
                qkv = torch.randn(1, t, hkv * (g + 2), d, device="cuda", dtype=torch.bfloat16)
                start = torch.full((1,), kv_len - t, device="cuda")
                row = {"rule": list(ca.row_tiles(g, t, hkv))}
                for rows in (16, 32, 64):
                    if rows > max(16, 1 << (g * t - 1).bit_length()):
                        continue
                    for chunk in (None, 128, 256):
                        row[f"{rows}/{chunk or 'rule'}"] = per_call_us(
                            lambda i, c=chunk, r=rows: ca.cache_attention(qkv, cache[i, 0], cache[i, 1], start, None,
                                                                          kv_len, g, c, r))
                results[f"{shape}/{kv_len}/t{t}"] = row
                print(shape, kv_len, t, {k: (round(x, 2) if isinstance(x, float) else x) for k, x in row.items()},
                      flush=True)
                del cache
    print(write_record("cache-attention-tiles", {"argv": sys.argv}, results, out_dir))


def split_probe(out_dir: str) -> None:
    """Per layer, batch 1, 1 and 6 new tokens: every split size against the rule's at the spans a
    decode or verify graph takes (multiples of 128 from 640), for each head shape."""
    results = {}
    for shape in HEADS:
        for kv_len in (640, 1024, 2048, 4096):
            for t in (1, 6):
                r = layer_probe(shape, 1, kv_len, t)
                results[f"{shape}/{kv_len}/t{t}"] = r
                print(shape, kv_len, t, {k: round(x, 2) for k, x in r.items()}, flush=True)
    print(write_record("cache-attention-split", {"argv": sys.argv}, results, out_dir))


def main(out_dir: str) -> None:
    results = {"per_layer_us": {}, "step_ms": {}}
    for shape in ("smollm2-135m", "llama-3.1-8b"):
        for b in (1, 16):
            for kv_len in (128, 512, 2048, 4096):
                for t in (1, 6):
                    r = layer_probe(shape, b, kv_len, t)
                    results["per_layer_us"][f"{shape}/b{b}/{kv_len}/t{t}"] = r
                    print(shape, b, kv_len, t, {k: round(x, 2) for k, x in r.items()}, flush=True)
    for shape, ctxs in (("smollm2-135m", (128, 512, 2048)), ("llama-3.1-8b", (512, 4096))):
        for on in (False, True):  # the model with the kernel, then without (everything else the same)
            kernels = dataclasses.replace(Kernels.choose("cuda"), cache_attention=on)
            model = random_model(shape, "cuda", torch.bfloat16, kernels=kernels)
            for ctx in ctxs:
                ms = forward_curve(model, (1, 6, 16, 64), ctx, graphs=True, repeats=50)
                results["step_ms"][f"{shape}@{ctx}/{'triton' if on else 'sdpa'}"] = ms
                print(shape, ctx, "triton" if on else "sdpa", {k: round(x, 4) for k, x in ms.items()}, flush=True)
            del model
            torch.cuda.empty_cache()
    print(write_record("cache-attention-probe", {"argv": sys.argv}, results, out_dir))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[2] == "tiles":
        tiles_probe(sys.argv[1])
    elif len(sys.argv) > 2 and sys.argv[2] == "split":
        split_probe(sys.argv[1])
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else "/tmp")
