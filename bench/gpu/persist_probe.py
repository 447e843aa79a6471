"""What a kernel boundary costs against a grid-wide wait inside one persistent kernel: the question
before a layer runs as one kernel. A chain of S one-row GEMVs, y_{s+1} = W_s y_s (W_s (N, N), bf16,
every stage its own weights, so the bytes stream from HBM), timed three ways in CUDA graphs:

- `graphed`: S launches of eaglet's own GEMV (models/gemv.py, its tiles, launched as the package
  launches it: on compute capability 9 dependent, `PRE_SLICES` slices read before its wait), one graph;
  `graphed plain`: the same with every launch plain (`PRE_SLICES = 0`);
- `persistent`: one kernel of P programs (`--per-sm` programs an SM, all resident), each stage's
  tiles dealt round-robin, stages separated by a grid-wide barrier (a counter: release on arrival,
  acquire while spinning; the stage's input read past L1);
- `persistent+prefetch`: the same, each program's first weight tile of the next stage loaded
  before it waits (weights do not depend on the previous stage), as down_pre does with gate-up;
- `pdl`, `pdl+preN`: S launches in one graph, each launched dependent on the one before (programmatic
  dependent launch), every program triggering its dependents at its start; with preN it loads its first
  N weight slices (all of them where N slices cover the row) before it waits for the input, so a stage's
  weights stream while the stage before finishes. The grid is one wave: BN rows a program.

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


@triton.jit
def pdl_kernel(W, X, Y, N: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRE: tl.constexpr):
    """Y = W X for one stage, launched dependent on the stage before: PRE (0-2) slices of BK columns
    loaded before gdc_wait, the rest after."""
    tl.extra.cuda.gdc_launch_dependents()
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    c = tl.arange(0, BK)
    rm = rows < N
    w0 = tl.zeros((BN, BK), dtype=W.dtype.element_ty)
    w1 = tl.zeros((BN, BK), dtype=W.dtype.element_ty)
    if PRE >= 1:
        w0 = tl.load(W + rows[:, None] * N + c[None, :], mask=rm[:, None] & (c < N)[None, :], other=0.0)
    if PRE >= 2:
        w1 = tl.load(W + rows[:, None] * N + (BK + c)[None, :], mask=rm[:, None] & ((BK + c) < N)[None, :], other=0.0)
    tl.extra.cuda.gdc_wait()
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    if PRE >= 1:
        acc += w0.to(tl.float32) * tl.load(X + c, mask=c < N, other=0.0).to(tl.float32)[None, :]
    if PRE >= 2:
        acc += w1.to(tl.float32) * tl.load(X + BK + c, mask=(BK + c) < N, other=0.0).to(tl.float32)[None, :]
    for k0 in range(PRE * BK, N, BK):
        km = (k0 + c) < N
        w = tl.load(W + rows[:, None] * N + (k0 + c)[None, :], mask=rm[:, None] & km[None, :], other=0.0,
                    eviction_policy="evict_first")
        acc += w.to(tl.float32) * tl.load(X + k0 + c, mask=km, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows, tl.sum(acc, 1).to(Y.dtype.element_ty), mask=rm)


def pdl_rows(n: int, w, x, y, ref, bytes_ms: float, stages: int) -> list[dict]:
    """The `pdl` paths: row tiles of 8 and 16 (a one-wave grid), the row in one or two slices, 0-2 preloaded."""
    rows = []
    bk_full = triton.next_power_of_2(n)
    for bn, warps in ((8, 8), (16, 8), (4, 4)):
        for bk, pres in ((bk_full, (0, 1)), (bk_full // 2, (1, 2))):
            for pre in pres:
                def run(bn=bn, bk=bk, pre=pre, warps=warps):
                    y[0].copy_(x)
                    for s in range(stages):
                        pdl_kernel[(triton.cdiv(n, bn),)](w[s], y[s], y[s + 1], N=n, BN=bn, BK=bk, PRE=pre,
                                                          num_warps=warps, launch_pdl=True)
                try:
                    ms = event_ms(graphed(run))
                except Exception as e:  # e.g. registers: report and go on
                    print(f"N={n} pdl BN={bn} BK={bk} pre={pre}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                err = (y[stages].float() - ref).abs().max().item() / ref.abs().max().item()
                rows.append(dict(n=n, stages=stages, path=f"pdl+pre{pre}" if pre else "pdl", programs=triton.cdiv(n, bn),
                                 bn=bn, bk=bk, warps=warps, us_stage=ms * 1e3 / stages,
                                 bytes_us_stage=bytes_ms * 1e3 / stages, rel_err_vs_graphed=err))
    return rows


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


def probe(n: int, stages: int, bw: float, per_sm: list[int], tiles: list[tuple[int, int, int]],
          pdl: bool = True) -> list[dict]:
    from eaglet.models import gemv as gemv_module
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
    pre, gemv_module.PRE_SLICES = gemv_module.PRE_SLICES, 0
    try:
        ms = event_ms(graphed(chain))
    finally:
        gemv_module.PRE_SLICES = pre
    rows.append(dict(n=n, stages=stages, path="graphed plain", us_stage=ms * 1e3 / stages,
                     bytes_us_stage=bytes_ms * 1e3 / stages))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    y = torch.empty(stages + 1, n, device="cuda", dtype=torch.bfloat16)
    bar = torch.zeros(1, device="cuda", dtype=torch.int32)
    if pdl:
        rows += pdl_rows(n, w, x, y, ref, bytes_ms, stages)
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
    ap.add_argument("--per-sm", default="1,2,4", help="programs an SM for the persistent paths ('' for none)")
    ap.add_argument("--no-pdl", action="store_true", help="leave out the dependent-launch paths")
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
        rows += probe(n, min(stages, 1024), bw, [int(k) for k in a.per_sm.split(",") if k], tiles,
                      not a.no_pdl)
    print(f"record: {write_record('persist-probe', vars(a), dict(copy_gbs=bw, rows=rows), a.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
