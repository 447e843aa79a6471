"""What a kernel boundary costs against a grid-wide wait inside one persistent kernel: the question
before a layer runs as one kernel. A chain of S one-row GEMVs, y_{s+1} = W_s y_s (W_s (N, N), bf16,
every stage its own weights, so the bytes stream from HBM), timed three ways in CUDA graphs:

- `graphed`: S launches of eaglet's own GEMV (models/gemv.py, its tiles), one graph;
- `persistent`: one kernel of P programs (`--per-sm` programs an SM, all resident), each stage's
  tiles dealt round-robin, stages separated by a grid-wide barrier (a counter: release on arrival,
  acquire while spinning; the stage's input read past L1);
- `persistent+prefetch`: the same, each program's first weight tile of the next stage loaded
  before it waits (weights do not depend on the previous stage), as down_pre does with gate-up.

Reports µs a stage, the bytes' time at the measured copy bandwidth, and the overhead a stage pays
over its bytes. A probe, not part of the package.

  python3 bench/gpu/persist_probe.py OUT_DIR [N,N..]   # default 2048 (Qwen3's hidden) and 576 (SmolLM2's)
"""
import argparse
import sys

import torch
import triton
import triton.language as tl

from eaglet.perf.curves import time_ms


@triton.jit
def _wait(bar, target):
    """Spin until the counter reaches target (acquire: the stores released before it are visible)."""
    n = tl.atomic_add(bar, 0, sem="acquire")
    while n < target:
        n = tl.atomic_add(bar, 0, sem="acquire")


@triton.jit
def chain_kernel(W, Y, bar, S, N: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREFETCH: tl.constexpr):
    """Stage s: Y[s+1] = W[s] Y[s]; program p takes row tiles p, p+P, ..; a barrier between
    stages. With PREFETCH the first tile's first slice of the next stage is loaded before the wait."""
    pid, P = tl.program_id(0), tl.num_programs(0)
    tiles = N // BN
    r = tl.arange(0, BN)
    c = tl.arange(0, BK)
    first = (pid * BN + r)[:, None] * N + c[None, :]
    fm = ((pid * BN + r) < N)[:, None] & (c < N)[None, :]
    w0 = tl.load(W + first, mask=fm, other=0.0)
    for s in range(S):
        if s > 0:
            _wait(bar, s * P)
        src = Y + s * N
        for t in range(pid, tiles, P):
            rows = t * BN + r
            acc = tl.zeros((BN, BK), dtype=tl.float32)
            for k0 in range(0, N, BK):
                km = (k0 + c) < N
                x = tl.load(src + k0 + c, mask=km, other=0.0, cache_modifier=".cg")
                if PREFETCH and t == pid and k0 == 0:
                    w = w0
                else:
                    w = tl.load(W + s * N * N + rows[:, None] * N + (k0 + c)[None, :], mask=km[None, :], other=0.0,
                                eviction_policy="evict_first")
                acc += w.to(tl.float32) * x[None, :].to(tl.float32)
            tl.store(Y + (s + 1) * N + rows, tl.sum(acc, 1).to(Y.dtype.element_ty))
        if PREFETCH and s + 1 < S:
            w0 = tl.load(W + (s + 1) * N * N + first, mask=fm, other=0.0)
        tl.debug_barrier()  # every thread's stores issued before the arrival
        tl.atomic_add(bar, 1, sem="release")


def event_ms(fn, repeats=30) -> float:
    """Median ms of fn() after three warm-up calls."""
    for _ in range(3):
        fn()
    return time_ms(fn, torch.device("cuda"), repeats)


def graphed(fn):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def copy_gbs() -> float:
    a = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() / event_ms(lambda: b.copy_(a)) / 1e6


def resident(consts: dict, warps: int, *args) -> int:
    """How many programs of the compiled kernel one SM holds at once (threads, registers, shared memory)."""
    k = chain_kernel.warmup(*args, **consts, num_warps=warps, grid=(1,))
    if hasattr(k, "_init_handles"):
        k._init_handles()
    regs_warp = -(-k.n_regs * 32 // 256) * 256
    props = torch.cuda.get_device_properties(0)
    smem = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
    by_smem = smem // max(1, k.metadata.shared) if k.metadata.shared else 32
    return min(2048 // (32 * warps), 65536 // regs_warp // warps, by_smem, 32)


def probe(n: int, stages: int, bw: float, per_sm: list[int], tiles: list[tuple[int, int, int]]) -> list[dict]:
    from eaglet.models.gemv import gemv

    torch.manual_seed(0)
    w = (torch.randn(stages, n, n, device="cuda") / n ** 0.5).to(torch.bfloat16)
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    bytes_ms = w.numel() * 2 / bw / 1e6
    rows = []

    ys = [None] * (stages + 1)

    def chain():
        y = x[None]
        for s in range(stages):
            y = gemv(y, w[s])
        ys[stages] = y

    ms = event_ms(graphed(chain))
    ref = ys[stages].float().flatten()
    rows.append(dict(n=n, stages=stages, path="graphed", us_stage=ms * 1e3 / stages, bytes_us_stage=bytes_ms * 1e3 / stages))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    y = torch.empty(stages + 1, n, device="cuda", dtype=torch.bfloat16)
    bar = torch.zeros(1, device="cuda", dtype=torch.int32)
    for k in per_sm:
        for bn, bk, warps in tiles:
            if n % bn:
                continue
            for pre in (False, True):
                fit = resident(dict(N=n, BN=bn, BK=bk, PREFETCH=pre), warps, w, y, bar, stages)
                if fit < k:  # a grid-wide wait needs every program resident at once
                    print(f"N={n} BN={bn} BK={bk} prefetch={pre}: {fit} programs an SM fit, not {k}", flush=True)
                    continue
                p = min(sms * k, n // bn)

                def run():
                    bar.zero_()
                    y[0].copy_(x)
                    chain_kernel[(p,)](w, y, bar, stages, N=n, BN=bn, BK=bk, PREFETCH=pre, num_warps=warps)

                ms = event_ms(graphed(run))
                err = (y[stages].float() - ref).abs().max().item() / ref.abs().max().item()
                rows.append(dict(n=n, stages=stages, path="persistent+prefetch" if pre else "persistent", programs=p,
                                 per_sm=k, bn=bn, bk=bk, warps=warps, us_stage=ms * 1e3 / stages,
                                 bytes_us_stage=bytes_ms * 1e3 / stages, rel_err_vs_graphed=err))
    for r in rows:
        r["overhead_us_stage"] = r["us_stage"] - r["bytes_us_stage"]
        print(f"N={r['n']:5d} {r['path']:20s} P={r.get('programs', '-')!s:5s} BN={r.get('bn', '-')!s:3s} "
              f"BK={r.get('bk', '-')!s:5s} w={r.get('warps', '-')!s:2s} {r['us_stage']:7.2f} µs/stage "
              f"(bytes {r['bytes_us_stage']:.2f}, over {r['overhead_us_stage']:+.2f})"
              + (f" err {r['rel_err_vs_graphed']:.1e}" if "rel_err_vs_graphed" in r else ""), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("sizes", nargs="?", default="2048,576")
    ap.add_argument("--per-sm", default="1,2,4")
    a = ap.parse_args()
    from eaglet.perf.record import write_record

    bw = copy_gbs()
    print(f"copy bandwidth {bw:.0f} GB/s", flush=True)
    rows = []
    for n in map(int, a.sizes.split(",")):
        stages = max(8, (768 << 20) // (2 * n * n))  # ~768 MB of weights: well past L2
        tiles = [(2, 2048, 8), (4, 2048, 8), (8, 1024, 8)] if n >= 2048 else [(2, 1024, 4), (4, 1024, 4), (8, 512, 4)]
        if n < 2048:
            tiles = [(bn, min(bk, triton.next_power_of_2(n)), wp) for bn, bk, wp in tiles]
        rows += probe(n, min(stages, 1024), bw, [int(k) for k in a.per_sm.split(",")], tiles)
    print(f"record: {write_record('persist-probe', vars(a), dict(copy_gbs=bw, rows=rows), a.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
