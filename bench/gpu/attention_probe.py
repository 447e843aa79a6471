"""Which SDPA backend eaglet's attention should use on this GPU (masked attention over the cache:
decode, verify and tree verify all pass a mask): the forward cost of 1, 16 and 64 new tokens,
graphed, per backend, for SmolLM2-135M and Llama-3.1-8B shapes. Writes one JSON record."""
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from eaglet.perf.curves import forward_curve
from eaglet.perf.record import write_record
from eaglet.perf.shapes import random_model

BACKENDS = {"math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
results = {}
for shape, ctx in (("smollm2-135m", 512), ("llama-3.1-8b", 512), ("llama-3.1-8b", 4096)):
    model = random_model(shape, "cuda", torch.bfloat16)
    for name, backend in BACKENDS.items():
        try:
            with sdpa_kernel([backend]):
                ms = forward_curve(model, (1, 16, 64), ctx, graphs=True)
        except RuntimeError as e:  # a backend that cannot run this case
            ms = {"error": str(e).splitlines()[0][:200]}
        results.setdefault(f"{shape}@{ctx}", {})[name] = ms
        print(shape, ctx, name, ms, flush=True)
    del model
    torch.cuda.empty_cache()
print(write_record("attention-probe", {"argv": sys.argv}, results, sys.argv[1] if len(sys.argv) > 1 else "/tmp"))
