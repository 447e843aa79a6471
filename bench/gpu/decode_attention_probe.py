"""One-token attention on the GPU: eaglet's Triton kernel (store + attend, models/decode_attention.py)
against the general path (indexed store, additive mask, SDPA), and the split size that suits each
span. Two views, both graphed, medians of CUDA-event timings:

- per layer: 30 calls (one per layer of a cache) captured in one graph, µs per call, for SmolLM2-135M
  (3 kv heads x 3, d 64) and Llama-3.1-8B (8 x 4, d 128) head shapes, batch 1 and 16, spans 128 ..
  4096, the kernel at several split sizes and at its default;
- the whole model: forward_curve's one-token decode step of SmolLM2 and the 8B shape, kernel on and
  off (everything else the same).

  python3 bench/gpu/decode_attention_probe.py OUT_DIR
"""
import sys

import torch
import torch.nn.functional as F

from eaglet.models import decode_attention as da
from eaglet.models.attention import additive_bias
from eaglet.perf.curves import forward_curve, time_ms
from eaglet.perf.record import write_record
from eaglet.perf.shapes import random_model

LAYERS = 30
HEADS = {"smollm2-135m": (3, 3, 64), "llama-3.1-8b": (8, 4, 128)}


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


def layer_probe(shape: str, b: int, kv_len: int) -> dict:
    hkv, g, d = HEADS[shape]
    dev, dt = "cuda", torch.bfloat16
    cache = torch.randn(LAYERS, 2, b, hkv, kv_len + 64, d, device=dev, dtype=dt)  # KVCache's layout
    k, v = cache[:, 0], cache[:, 1]
    q = torch.randn(b, hkv, g, d, device=dev, dtype=dt)
    kv = torch.randn(b, 1, 2, hkv, d, device=dev, dtype=dt)
    slots = torch.full((b, 1), kv_len - 1, device=dev)
    rows = torch.arange(b, device=dev)[:, None]
    mask = (torch.arange(kv_len, device=dev) <= kv_len - 1).expand(b, 1, 1, kv_len)

    def general(i):
        cache[i][:, rows, :, slots] = kv  # KVCache.write
        bias = additive_bias(mask, g, dt)
        return F.scaled_dot_product_attention(q, k[i, :, :, :kv_len], v[i, :, :, :kv_len], attn_mask=bias)

    out = {"sdpa+store": per_call_us(general)}
    for chunk in (64, 128, 256, 512, 1024, 4096):
        if chunk >= 64 and -(-kv_len // chunk) <= da.MAX_SPLITS and chunk <= max(64, 2 * kv_len):
            out[f"triton/{chunk}"] = per_call_us(lambda i, c=chunk: da.decode_attention(q, kv, k[i], v[i], slots, kv_len, c))
    out["triton/default"] = per_call_us(lambda i: da.decode_attention(q, kv, k[i], v[i], slots, kv_len))
    out["default_split"] = da.split_size(kv_len)
    return out


def main(out_dir: str) -> None:
    da.enable()
    results = {"per_layer_us": {}, "decode_step_ms": {}}
    for shape in HEADS:
        for b in (1, 16):
            for kv_len in (128, 256, 512, 1024, 2048, 4096):
                r = layer_probe(shape, b, kv_len)
                results["per_layer_us"][f"{shape}/b{b}/{kv_len}"] = r
                print(shape, b, kv_len, {k: round(x, 2) for k, x in r.items()}, flush=True)
    for shape, ctxs in (("smollm2-135m", (128, 512, 2048)), ("llama-3.1-8b", (512, 4096))):
        model = random_model(shape, "cuda", torch.bfloat16)
        for ctx in ctxs:
            for on in (False, True):
                da.enable(on)
                ms = forward_curve(model, (1,), ctx, graphs=True, repeats=50)["1"]
                results["decode_step_ms"][f"{shape}@{ctx}/{'triton' if on else 'sdpa'}"] = ms
                print(shape, ctx, "triton" if on else "sdpa", f"{ms:.4f} ms", flush=True)
        del model
        torch.cuda.empty_cache()
    print(write_record("decode-attention-probe", {"argv": sys.argv}, results, out_dir))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp")
