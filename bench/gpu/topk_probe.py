"""The draft tree's top-k picks, timed alone on the GPU (no model needed): torch (log-softmax, then
topk or a stable sort; argmax for a chain) against eaglet's kernel (eaglet/spec/topk.py: two block
reductions per pick) at several warp counts, and a candidate that packs each value with its index
into one int64 key, so each pick is one reduction. The shapes are those of trees 5,4,16 and 6,8,32
over SmolLM2's 16,384-id draft vocabulary, and a chain's argmax. Each call is timed inside a CUDA
graph (median of 7 replays of 20 calls), so launch latency is left out as it is in the draft graph.
A probe for choosing the kernel, not part of the package.

  python3 bench/gpu/topk_probe.py OUT_DIR
  TRITON_INTERPRET=1 python3 bench/gpu/topk_probe.py --check   # the CPU: every variant equals torch
"""
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

from eaglet.models.cache_attention import pow2
from eaglet.spec import topk as topk_mod

# (name, rows, width, k, log_softmax): the picks of one tree step (B = 1)
CASES = [("root, 5,4,16", 1, 16384, 4, True), ("children, 5,4,16", 4, 16384, 4, True),
         ("frontier, 5,4,16", 1, 16, 4, False), ("select, 5,4,16", 1, 68, 15, False),
         ("root, 6,8,32", 1, 16384, 8, True), ("children, 6,8,32", 8, 16384, 8, True),
         ("frontier, 6,8,32", 1, 64, 8, False), ("select, 6,8,32", 1, 328, 31, False),
         ("chain argmax", 1, 16384, 1, False)]


@triton.jit
def packed_topk(x_ptr, val_ptr, idx_ptr, n, stride, K: tl.constexpr, BLOCK: tl.constexpr,
                LOG_SOFTMAX: tl.constexpr):
    """As eaglet's kernel, but each pick is one max over int64 keys: the float's bits made
    order-preserving as a signed int in the high half, BLOCK - 1 - index in the low half (ties to
    the lower index); a picked or padded lane gets the smallest key."""
    row = tl.program_id(0)
    x, offs, live, top, lse = topk_mod.row_stats(x_ptr, n, stride, BLOCK, LOG_SOFTMAX)
    bits = x.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    dead = tl.full([BLOCK], -2147483648, tl.int32).to(tl.int64) << 32
    key = tl.where(live, (ordered.to(tl.int64) << 32) | (BLOCK - 1 - offs).to(tl.int64), dead)
    for j in tl.static_range(K):
        kmax = tl.max(key, 0)
        at = BLOCK - 1 - (kmax & 0xFFFFFFFF).to(tl.int32)
        o = (kmax >> 32).to(tl.int32)
        best = tl.where(o >= 0, o, o ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
        if LOG_SOFTMAX:
            best = (best - top) - lse
        tl.store(val_ptr + row * K + j, best)
        tl.store(idx_ptr + row * K + j, at.to(tl.int64))
        key = tl.where(offs == at, dead, key)


def packed(x: torch.Tensor, k: int, log_softmax: bool, warps: int):
    rows = x.reshape(-1, x.shape[-1])
    vals = torch.empty(rows.shape[0], k, dtype=torch.float32, device=x.device)
    idx = torch.empty(rows.shape[0], k, dtype=torch.long, device=x.device)
    packed_topk[(rows.shape[0],)](rows, vals, idx, rows.shape[-1], rows.stride(0), K=k,
                                  BLOCK=max(16, pow2(rows.shape[-1])), LOG_SOFTMAX=log_softmax, num_warps=warps)
    return vals, idx


def eaglet_kernel(x: torch.Tensor, k: int, log_softmax: bool, warps: int):
    n = x.shape[-1]
    vals = torch.empty(x.shape[0], k, dtype=torch.float32, device=x.device)
    idx = torch.empty(x.shape[0], k, dtype=torch.long, device=x.device)
    topk_mod.row_topk_kernel[(x.shape[0],)](x, vals, idx, vals, n, x.stride(0), K=k, BLOCK=max(16, pow2(n)),
                                      LOG_SOFTMAX=log_softmax, OFFSET=False, num_warps=warps)
    return vals, idx


def torch_pick(x: torch.Tensor, k: int, log_softmax: bool, stable: bool):
    if k == 1 and not log_softmax:
        return None, x.argmax(-1, keepdim=True)
    y = x.float().log_softmax(-1) if log_softmax else x.float()
    if stable:
        v, i = y.sort(dim=-1, descending=True, stable=True)
        return v[..., :k], i[..., :k]
    return y.topk(k, -1)


def warp_choices(n: int) -> list[int]:
    return [w for w in (1, 2, 4, 8, 16) if w * 32 <= max(32, pow2(n)) and (n < 4096 or w >= 4)]


def check() -> None:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    for name, rows, n, k, ls in CASES:
        x = (torch.randn(rows, n, generator=g) * 3).to(dev)
        rv, ri = torch_pick(x, k, ls, stable=True)
        for fn in (eaglet_kernel, packed):
            v, i = fn(x, k, ls, warp_choices(n)[-1])
            assert torch.equal(i, ri), (name, fn.__name__)
            if rv is not None:
                torch.testing.assert_close(v, rv, atol=1e-5, rtol=1e-5)
    x = torch.randint(0, 4, (2, 300), generator=g).float().to(dev)  # ties: lower index first
    x[1] = float("-inf")
    want = x.sort(dim=-1, descending=True, stable=True).indices[:, :20]
    assert torch.equal(packed(x, 20, False, 4)[1], want) and torch.equal(eaglet_kernel(x, 20, False, 4)[1], want)
    print("every variant equals torch on", len(CASES), "cases and on ties")


def main(out_dir: str) -> None:
    from layer_probe import timed_graph  # bench/gpu/ is the script's directory

    from eaglet.perf.record import write_record

    torch.manual_seed(0)
    results = {}
    for name, rows, n, k, ls in CASES:
        x = (torch.randn(rows, n, device="cuda") * 3).to(torch.bfloat16 if n >= 4096 else torch.float32)  # logits, scores
        variants = {"torch": lambda: torch_pick(x, k, ls, stable=name.startswith("select"))}
        for w in warp_choices(n):
            variants[f"eaglet, {w} warps"] = lambda w=w: eaglet_kernel(x, k, ls, w)
            variants[f"packed, {w} warps"] = lambda w=w: packed(x, k, ls, w)
        times = {}
        for v, fn in variants.items():
            calls = 20
            times[v] = 1e3 * timed_graph(lambda fn=fn: [fn() for _ in range(calls)]) / calls  # µs a call
        best = min((t, v) for v, t in times.items() if v != "torch")
        results[name] = {"rows": rows, "width": n, "k": k, "log_softmax": ls, "us": times}
        print(f"{name:<20} torch {times['torch']:6.2f} us, best: {best[1]} {best[0]:6.2f} us", flush=True)
        print("    " + "; ".join(f"{v} {t:.2f}" for v, t in times.items() if v != "torch"), flush=True)
    print(write_record("topk-probe", {"argv": sys.argv, "cases": CASES}, results, out_dir))


if __name__ == "__main__":
    if sys.argv[1] == "--check":
        assert torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1"
        check()
    else:
        main(sys.argv[1])
