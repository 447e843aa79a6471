"""Where a batch-1 decode step of Llama-3.1-8B loses to the memory roofline, measured on stand-ins of
its 32 layers (random bfloat16 weights, one set per layer as in the model, so nothing stays in L2):

  gemms      the four projections per layer and lm_head, cuBLAS, back to back: their bandwidth
  layer      the same with five small kernels per layer between them (norms, RoPE, attention, SiLU)
  prefetch   `layer`, with each projection's first bytes read into L2 on a second stream while
             the small kernels before it run (HBM is idle then): what overlap could win back
  triton     `gemms` with eaglet's Triton GEMV (eaglet/models/gemv.py) instead of cuBLAS (best of a few
             tile shapes per projection)

Each variant is one CUDA graph of a whole step, replayed; median of 7 replays after warm-up. Also the
read bandwidth (a Triton reduction over 4 GB) and the copy bandwidth eaglet's roofline uses.
A probe for choosing the decode step's design, not part of the package.

`sweep` times eaglet's own GEMV kernel (eaglet/models/gemv.py) over a grid of tile shapes against
cuBLAS for each projection of a model shape, all layers' weights in turn, and what `gemv.tiles` picks;
for 2 to 16 rows the tensor-core kernel's tiles include slices of 1024 and 2048 columns where they fit
(`long_slices`, also in `glu`; on the 8B at 2-16 rows they win nowhere), and two
candidates: `rows_gemv` (CUDA cores, up to 8 rows) and `dot_splitk` (the tensor-core kernel with K
split across programs, configs of six numbers, the last the split).

  python3 bench/gpu/layer_probe.py OUT_DIR
  python3 bench/gpu/layer_probe.py OUT_DIR sweep [llama-3.1-8b | qwen3-8b | smollm2-135m | qwen3-30b-a3b] [ROWS, e.g. 1,6,16,64]
  SWEEP=split python3 ...   (2 to 16 rows: what dot_tiles picks against the split-K candidates only)
  SWEEP=swap python3 ...    (2 to 16 rows: against `dot_swap` and `dot_swap_tma`, the operands swapped)
  python3 bench/gpu/layer_probe.py OUT_DIR glu [SHAPE] [ROWS]   (gate-up + SiLU·mul: unfused against gemv.glu)
"""
import os
import statistics
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from eaglet.perf.record import write_record

H, Q, KV, I, V, L = 4096, 4096, 1024, 14336, 128256, 32
SHAPES = {"qkv": (Q + 2 * KV, H), "o": (H, Q), "gate_up": (2 * I, H), "down": (H, I)}
dev = torch.device("cuda")


@triton.jit
def rows_gemv(X, W, Y, M, N, sx, K: tl.constexpr, MP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """A candidate for 2 to 8 rows (verify): eaglet's GEMV on CUDA cores with every row multiplied by
    each weight slice as it streams by; for narrow models the multiplies are cheap and the tensor-core
    kernel's tiles are mostly padding."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    rm = rows < N
    m = tl.arange(0, MP)
    acc = tl.zeros((MP, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        cm = cols < K
        w = tl.load(W + rows[:, None] * K + cols[None, :], mask=rm[:, None] & cm[None, :], other=0.0,
                    eviction_policy="evict_first")
        x = tl.load(X + m[:, None] * sx + cols[None, :], mask=(m < M)[:, None] & cm[None, :], other=0.0)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], 2)
    tl.store(Y + m[:, None] * N + rows[None, :], acc.to(Y.dtype.element_ty), mask=(m < M)[:, None] & rm[None, :])


@triton.jit
def dot_splitk(X, W, Y, P, C, M, N, sx, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               SPLIT: tl.constexpr):
    """A candidate for 2 to 16 rows (verify): eaglet's tensor-core kernel with K cut into SPLIT ranges,
    so SPLIT times as many programs stream the weights (the 8B's 4096-row projections give the
    plain kernel one program per SM). Each program writes its range's float32 sums to P (SPLIT, BM, N);
    the last of a column block to finish (counter C, which it resets) adds the ranges and writes Y:
    one kernel, no second reduction launch. Needs K % (SPLIT * BK) == 0."""
    cb = tl.program_id(0)
    s = tl.program_id(1)
    m = tl.arange(0, BM)
    cols = cb * BN + tl.arange(0, BN)
    mm, cm = m < M, cols < N
    KS: tl.constexpr = K // SPLIT
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, KS, BK):
        kk = s * KS + k0 + tl.arange(0, BK)
        x = tl.load(X + m[:, None] * sx + kk[None, :], mask=mm[:, None], other=0.0)
        w = tl.load(W + cols[:, None] * K + kk[None, :], mask=cm[:, None], other=0.0, eviction_policy="evict_first")
        acc = tl.dot(x, tl.trans(w), acc)
    part = P + m[:, None] * N + cols[None, :]
    tl.store(part + s * BM * N, acc, mask=cm[None, :])
    tl.debug_barrier()  # every thread's partial stored before the program says it is done
    if tl.atomic_add(C + cb, 1, sem="acq_rel") == SPLIT - 1:
        tot = tl.zeros((BM, BN), dtype=tl.float32)
        for i in range(SPLIT):
            tot += tl.load(part + i * BM * N, mask=cm[None, :], other=0.0, cache_modifier=".cg")
        tl.store(Y + m[:, None] * N + cols[None, :], tot.to(Y.dtype.element_ty), mask=mm[:, None] & cm[None, :])
        tl.atomic_xchg(C + cb, 0)


@triton.jit
def dot_swap(X, W, Y, M, N, sx, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """A candidate for 2 to 16 rows (verify): the tensor-core kernel with its operands swapped, Yᵀ = W Xᵀ.
    eaglet's kernel puts X's 16 rows on the instruction's wide side, which Hopper's wgmma makes 64
    rows (so 3/4 of it is padding, or Triton falls back to the older mma); here the weight tile is
    that side (BN >= 64) and the few rows of X the narrow one (8 to 256 wide)."""
    m = tl.arange(0, BM)
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    mm, cm = m < M, cols < N
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        x = tl.load(X + m[:, None] * sx + kk[None, :], mask=mm[:, None], other=0.0)
        w = tl.load(W + cols[:, None] * K + kk[None, :], mask=cm[:, None], other=0.0, eviction_policy="evict_first")
        acc = tl.dot(w, tl.trans(x), acc)
    tl.store(Y + m[None, :] * N + cols[:, None], acc.to(Y.dtype.element_ty), mask=cm[:, None] & mm[None, :])


@triton.jit
def dot_swap_tma(X, W, Y, M, N, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """`dot_swap` with X and W read through tensor descriptors (Hopper's TMA copies whole tiles into
    shared memory; no per-thread addresses), X padded to BM rows by the descriptor's bounds."""
    m = tl.arange(0, BM)
    c0 = tl.program_id(0) * BN
    cols = c0 + tl.arange(0, BN)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for k0 in range(0, K, BK):
        x = X.load([0, k0])
        w = W.load([c0, k0])
        acc = tl.dot(w, tl.trans(x), acc)
    tl.store(Y + m[None, :] * N + cols[:, None], acc.to(Y.dtype.element_ty), mask=(cols < N)[:, None] & (m < M)[None, :])


@triton.jit
def read_into_l2(p, n, sink, BLOCK: tl.constexpr):
    """Read p[0:n] (keeping it in L2, evict_last) and write one float per program, so the reads stay."""
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    acc = tl.zeros((BLOCK,), tl.float32)
    for i in range(pid * BLOCK, n, nprog * BLOCK):
        offs = i + tl.arange(0, BLOCK)
        acc += tl.load(p + offs, mask=offs < n, other=0.0, eviction_policy="evict_last").to(tl.float32)
    tl.store(sink + pid, tl.sum(acc))


def timed_graph(step, reps: int = 7) -> float:
    """ms of one call of `step` captured in a CUDA graph: median of `reps` replays after warm-up."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main(out_dir: str) -> None:
    from eaglet.models import gemv as eg

    torch.manual_seed(0)
    w = {name: [torch.empty(n, k, dtype=torch.bfloat16, device=dev).normal_(0, 0.02) for _ in range(L)]
         for name, (n, k) in SHAPES.items()}
    head = torch.empty(V, H, dtype=torch.bfloat16, device=dev).normal_(0, 0.02)
    nbytes = sum(t.numel() * 2 for ts in w.values() for t in ts) + head.numel() * 2
    x = {name: torch.randn(1, k, dtype=torch.bfloat16, device=dev) for name, (n, k) in SHAPES.items()}
    y = {name: torch.empty(1, n, dtype=torch.bfloat16, device=dev) for name, (n, k) in SHAPES.items()}
    hidden = torch.randn(1, H, dtype=torch.bfloat16, device=dev)
    logits = torch.empty(1, V, dtype=torch.bfloat16, device=dev)
    small = torch.randn(1, Q + 2 * KV, dtype=torch.bfloat16, device=dev)
    sink = torch.empty(1024, dtype=torch.float32, device=dev)
    side = torch.cuda.Stream()
    results: dict = {"weight_bytes_per_step": nbytes}

    # bandwidths: copy (as eaglet's roofline) and read-only
    big = torch.empty(1 << 31, dtype=torch.bfloat16, device=dev).normal_()
    dst = torch.empty_like(big)
    copy_ms = timed_graph(lambda: dst.copy_(big))
    results["copy_tb_s"] = 2 * big.numel() * 2 / copy_ms / 1e9
    for progs in (264, 528, 1056):
        ms = timed_graph(lambda: read_into_l2[(progs,)](big, big.numel(), sink, BLOCK=4096, num_warps=4))
        results[f"read_tb_s_{progs}_programs"] = big.numel() * 2 / ms / 1e9
    del big, dst
    print({k: round(v, 3) for k, v in results.items() if k.endswith("tb_s") or "read" in k}, flush=True)

    def smalls(n=5):
        for _ in range(n):
            small.mul_(1.0001)

    def step(matmul, with_small=False, prefetch=0, progs=32):
        for layer in range(L):
            for name in SHAPES:
                wt = w[name][layer]
                if prefetch:
                    ev = torch.cuda.current_stream().record_event()
                    with torch.cuda.stream(side):
                        side.wait_event(ev)
                        n = min(wt.numel(), prefetch // 2)
                        read_into_l2[(progs,)](wt, n, sink, BLOCK=4096, num_warps=4)
                if with_small:
                    smalls(2 if name in ("qkv", "o") else 1)  # 6 per layer
                matmul(x[name], wt, y[name])
        matmul(hidden, head, logits)
        if prefetch:
            torch.cuda.current_stream().wait_stream(side)

    def cublas(xx, ww, yy):
        torch.matmul(xx, ww.t(), out=yy)

    def per_step(ms):
        return {"ms": ms, "tb_s": nbytes / ms / 1e9}

    results["gemms_cublas"] = per_step(timed_graph(lambda: step(cublas)))
    results["smalls_only"] = {"ms": timed_graph(lambda: [smalls(6) for _ in range(L)])}
    results["layer_cublas"] = per_step(timed_graph(lambda: step(cublas, True)))
    for mb in (4, 8, 16, 32):
        for progs in (16, 32, 66):
            key = f"prefetch_{mb}MB_{progs}progs"
            results[key] = per_step(timed_graph(lambda: step(cublas, True, mb << 20, progs)))
            print(key, round(results[key]["ms"], 3), flush=True)
    print({k: v for k, v in results.items() if "prefetch" not in k}, flush=True)

    # one projection alone (all 32 layers' weights in turn): cuBLAS and the best Triton tile shape
    configs = [(1, 1024, 4), (2, 1024, 4), (2, 512, 4), (4, 512, 4), (4, 1024, 8), (8, 512, 8), (8, 256, 4),
               (16, 256, 8)]
    best_cfg = {}
    for name, (n, k) in SHAPES.items():
        def one(fn):
            return lambda: [fn(x[name], w[name][layer], y[name]) for layer in range(L)]
        ref = F.linear(x[name], w[name][0])
        gb = n * k * 2 * L / 1e9
        row = {"cublas_tb_s": gb / timed_graph(one(cublas))}
        for bn, bk, warps in configs:
            def tri(xx, ww, yy, bn=bn, bk=bk, warps=warps):
                eg.gemv_kernel[(triton.cdiv(n, bn),)](xx, ww, yy, yy, n, K=k, BN=bn, BK=bk, EVEN_K=k % bk == 0,
                                                  HAS_BIAS=False, GLU=False, num_warps=warps)
            tri(x[name], w[name][0], y[name])
            err = (y[name].float() - ref.float()).abs().max().item()
            tb = gb / timed_graph(one(tri))
            if tb > row.get("triton_tb_s", 0):
                row.update(triton_tb_s=tb, triton_config=[bn, bk, warps], triton_max_err=err)
        best_cfg[name] = row["triton_config"]
        results[f"proj_{name}"] = row
        print(name, row, flush=True)

    def triton_best(xx, ww, yy):
        n, k = ww.shape
        bn, bk, warps = best_cfg.get(next((s for s, v in SHAPES.items() if v == (n, k)), ""), (4, 1024, 8))
        eg.gemv_kernel[(triton.cdiv(n, bn),)](xx, ww, yy, yy, n, K=k, BN=bn, BK=bk, EVEN_K=k % bk == 0,
                                          HAS_BIAS=False, GLU=False, num_warps=warps)

    results["gemms_triton"] = per_step(timed_graph(lambda: step(triton_best)))
    results["layer_triton"] = per_step(timed_graph(lambda: step(triton_best, True)))
    print({k: v for k, v in results.items() if k.startswith(("gemms", "layer"))}, flush=True)
    print(write_record("layer-probe", {"argv": sys.argv, "layers": L, "shapes": SHAPES}, results, out_dir))


def eaglet_kernel(cfg, xx, wt, yy, rows, n, k, glu=False):
    """eaglet's GEMV (one row, cfg = rows a program, slice width, warps) or tensor-core kernel (cfg =
    row tile, columns, slice width, warps, stages) with the given tile: yy (rows, n) = xx wtᵀ (glu:
    silu of the first n rows' products times the next n's)."""
    from eaglet.models import gemv as eg

    if rows == 1:
        bn, bk, warps = cfg
        eg.gemv_kernel[(triton.cdiv(n, bn),)](xx, wt, yy, yy, n, K=k, BN=bn, BK=bk, EVEN_K=k % bk == 0, HAS_BIAS=False,
                                          GLU=glu, num_warps=warps)
    else:
        bm, bn, bk, warps, stages = cfg
        eg.gemv_dot_kernel[(triton.cdiv(n, bn),)](xx, wt, yy, yy, rows, n, k, K=k, BM=bm, BN=bn, BK=bk,
                                              EVEN_K=k % bk == 0, HAS_BIAS=False, GLU=glu, num_warps=warps,
                                              num_stages=stages)


def long_slices(bm: int, k: int, operands: int = 1) -> list[tuple[int, ...]]:
    """Tensor-core tiles that read W as the GEMV does, 1024 or 2048 columns of each row at a time
    (the GEMV's best slices on the 8B; the first grids stopped at 512), where their stages fit in
    shared memory (operands: 2 for glu's gate and up rows)."""
    return [(bm, bn, bk, w, st) for bn in (16, 32) for bk in (1024, 2048) for w in (4, 8) for st in (2, 3)
            if bk <= k and (bm + operands * bn) * bk * 2 * st <= 200 * 1024]


SWEEP_SHAPES = {
    "llama-3.1-8b": (32, {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
                          "lm_head": (128256, 4096)}),
    "qwen3-8b": (36, {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
                      "lm_head": (151936, 4096)}),
    "smollm2-135m": (30, {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
                          "lm_head": (49152, 576)}),
    # its dense projections only (the experts are bench-moe's): ~7-8 µs each at decode on the H200 against
    # ~5 and ~4 of bytes (forward-profile-gpu-20261204-190608.json)
    "qwen3-30b-a3b": (48, {"qkv": (5120, 2048), "o": (2048, 4096), "lm_head": (151936, 2048)}),
}


ROWS = (1, 6, 16, 64)
SPLIT_ONLY = os.environ.get("SWEEP") == "split"  # the picked tile and the split-K candidates only
SWAP_ONLY = os.environ.get("SWEEP") == "swap"  # the picked tile and the swapped-operand candidates only


def swap_grid(bm: int, k: int) -> list[tuple]:
    """("swap" | "tma", columns, slice width, warps, stages) for `dot_swap` / `dot_swap_tma`, where
    their stages fit in shared memory."""
    return [(kind, bn, bk, w, st) for kind in ("swap", "tma") for bn in (64, 128) for bk in (128, 256)
            for w in (4, 8) for st in (3, 4) if bk <= k and (bm + bn) * bk * 2 * st <= 200 * 1024]


def sweep(out_dir: str, shape: str) -> None:
    from eaglet.models import gemv as eg

    layers, shapes = SWEEP_SHAPES[shape]
    results = {}
    for name, (n, k) in shapes.items():
        count = 1 if name == "lm_head" else layers
        ws = [torch.empty(n, k, dtype=torch.bfloat16, device=dev).normal_(0, 0.02) for _ in range(count)]
        gb = n * k * 2 * count / 1e9
        for rows in ROWS:
            xx = torch.randn(rows, k, dtype=torch.bfloat16, device=dev)
            yy = torch.empty(rows, n, dtype=torch.bfloat16, device=dev)
            part = torch.empty(9 * 16 * n, dtype=torch.float32, device=dev)  # split-K: up to 9 ranges of 16 rows
            count_ = torch.zeros(triton.cdiv(n, 16), dtype=torch.int32, device=dev)  # one counter a column block
            ref = F.linear(xx, ws[-1]).float()  # what yy holds after a run: the last layer's product

            def launcher(cfg):
                if cfg[0] == "tma":
                    from triton.tools.tensor_descriptor import TensorDescriptor
                    xd = TensorDescriptor.from_tensor(xx, [16, cfg[2]])
                    wds = [TensorDescriptor.from_tensor(wt, [cfg[1], cfg[2]]) for wt in ws]

                def run():
                    for i, wt in enumerate(ws):
                        if cfg[0] == "swap":
                            _, bn, bk, warps, stages = cfg
                            dot_swap[(triton.cdiv(n, bn),)](xx, wt, yy, rows, n, k, K=k, BM=16, BN=bn, BK=bk,
                                                            num_warps=warps, num_stages=stages)
                        elif cfg[0] == "tma":
                            _, bn, bk, warps, stages = cfg
                            dot_swap_tma[(triton.cdiv(n, bn),)](xd, wds[i], yy, rows, n, K=k, BM=16, BN=bn, BK=bk,
                                                                num_warps=warps, num_stages=stages)
                        elif len(cfg) == 6:  # the split-K candidate
                            bm, bn, bk, warps, stages, split = cfg
                            dot_splitk[(triton.cdiv(n, bn), split)](xx, wt, yy, part, count_, rows, n, k, K=k, BM=bm,
                                                                    BN=bn, BK=bk, SPLIT=split, num_warps=warps,
                                                                    num_stages=stages)
                        elif len(cfg) == 4:  # the rows_gemv candidate
                            bn, bk, warps, mp = cfg
                            rows_gemv[(triton.cdiv(n, bn),)](xx, wt, yy, rows, n, k, K=k, MP=mp, BN=bn, BK=bk,
                                                             num_warps=warps)
                        else:
                            eaglet_kernel(cfg, xx, wt, yy, rows, n, k)
                return run

            ms = timed_graph(lambda: [torch.matmul(xx, wt.t()) for wt in ws])
            row = {"shape": [n, k], "rows": rows, "copies": count, "cublas_us": ms * 1e3 / count,
                   "cublas_tb_s": gb / ms, "grid": {}}
            ms = timed_graph(lambda: [(wt @ xx.t()).t().contiguous() for wt in ws])
            row["cublas_w_xt_us"] = ms * 1e3 / count  # the other orientation, as the CPU path multiplies
            if rows == 1:
                grid = [(bn, bk, w) for bn in (1, 2, 4) for bk in (256, 512, 1024, 2048) for w in (2, 4, 8)
                        if bk <= max(256, 1 << (k - 1).bit_length())]
                picked = eg.tiles(n, k)
            else:
                bm = max(16, 1 << (rows - 1).bit_length())
                grid = [(bm, bn, bk, w, st) for bn in (16, 32, 64, 128) for bk in (128, 256, 512) for w in (4, 8)
                        for st in (2, 3, 4) if bn * bk <= 16384] + long_slices(bm, k)
                picked = eg.dot_tiles(rows, n, k)
                if k < 2048:  # SmolLM2's narrow projections: short K loops, split finer
                    split = [(bm, bn, bk, 4, st, sp) for bn in (16, 32) for bk in (32, 64, 128, 256) for st in (3, 4)
                             for sp in (2, 3, 4, 6, 8, 9) if k % (sp * bk) == 0]
                else:
                    split = [(bm, bn, bk, 4, 4, sp) for bn in (32, 64, 128) for bk in (128, 256) for sp in (2, 4, 8)
                             if bn * bk <= 16384 and k % (sp * bk) == 0]
                split = split if bm <= 16 else []
                grid = [picked or grid[0]] + split if SPLIT_ONLY else grid + split
                if SWAP_ONLY and bm <= 16:
                    grid = [picked or grid[0]] + swap_grid(bm, k)
                if rows <= 8 and not (SPLIT_ONLY or SWAP_ONLY):
                    mp = 1 << (rows - 1).bit_length()
                    grid += [(bn, bk, w, mp) for bn in (1, 2) for bk in (256, 512, 1024) for w in (4, 8)
                             if bk <= max(256, 1 << (k - 1).bit_length())]
            if picked is None:  # cuBLAS
                picked = grid[0]
            if picked not in grid:
                grid.append(picked)
            for cfg in grid:
                try:
                    run = launcher(cfg)
                    run()
                except triton.runtime.errors.OutOfResources:
                    continue
                except Exception as e:  # a candidate tile Triton cannot build here (e.g. a TMA box too wide)
                    print(f"  {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}", flush=True)
                    continue
                err = (yy.float() - ref).abs().max().item()
                ms = timed_graph(run)
                row["grid"][",".join(map(str, cfg))] = {"us": ms * 1e3 / count, "tb_s": gb / ms, "max_err": err}
            best = min(row["grid"], key=lambda c: row["grid"][c]["us"])
            pk = ",".join(map(str, picked))
            row.update(best=best, best_us=row["grid"][best]["us"], picked=pk, picked_us=row["grid"][pk]["us"])
            results[f"{name}_rows{rows}"] = row
            print(f"{name:<8} {n}x{k} rows {rows:>2}: cublas {row['cublas_us']:.2f} us ({row['cublas_tb_s']:.2f} TB/s), "
                  f"best {best} {row['best_us']:.2f} us ({row['grid'][best]['tb_s']:.2f} TB/s), picked {pk} "
                  f"{row['picked_us']:.2f} us", flush=True)
        del ws
    print(write_record("gemv-sweep", {"argv": sys.argv, "shape": shape}, results, out_dir))


def glu_sweep(out_dir: str, shape: str) -> None:
    """The MLP's gate-up then SiLU·mul: eaglet's few-row matmul with what dot_tiles/tiles pick, then the
    compiled SiLU·mul kernel (the unfused path), against `gemv.glu` (one kernel) over a grid of tiles."""
    from eaglet.models import gemv as eg

    layers, shapes = SWEEP_SHAPES[shape]
    n, k = shapes["gate_up"]
    i = n // 2
    ws = [torch.empty(n, k, dtype=torch.bfloat16, device=dev).normal_(0, 0.02) for _ in range(layers)]
    gb = n * k * 2 * layers / 1e9
    silu_mul = torch.compile(lambda y: F.silu(y[..., :i]) * y[..., i:], dynamic=True)
    eg.enable()
    results = {}
    for rows in ROWS:
        xx = torch.randn(rows, k, dtype=torch.bfloat16, device=dev)
        yy = torch.empty(rows, i, dtype=torch.bfloat16, device=dev)
        ref = silu_mul(F.linear(xx, ws[-1]))
        row = {"shape": [n, k], "rows": rows, "copies": layers, "grid": {}}
        ms = timed_graph(lambda: [silu_mul(eg.gemv(xx, wt)) for wt in ws])
        row["unfused_us"] = ms * 1e3 / layers
        ms = timed_graph(lambda: [eg.gemv(xx, wt) for wt in ws])
        row["matmul_alone_us"] = ms * 1e3 / layers
        ms = timed_graph(lambda: [eg.glu(xx, wt) for wt in ws])
        row["glu_picked_us"] = ms * 1e3 / layers
        if rows == 1:
            grid = [(bn, bk, w) for bn in (1, 2, 4) for bk in (256, 512, 1024, 2048) for w in (2, 4, 8)
                    if bk <= max(256, 1 << (k - 1).bit_length())]
        else:
            grid = [(16, bn, bk, w, st) for bn in (16, 32, 64) for bk in (64, 128, 256) for w in (4, 8)
                    for st in (2, 3, 4) if bn * bk <= 16384] + long_slices(16, k, operands=2)

        for cfg in grid:
            def run(cfg=cfg):
                for wt in ws:
                    eaglet_kernel(cfg, xx, wt, yy, rows, i, k, glu=True)
            try:
                run()
            except triton.runtime.errors.OutOfResources:
                continue
            err = (yy.float() - ref.float()).abs().max().item()
            ms = timed_graph(run)
            row["grid"][",".join(map(str, cfg))] = {"us": ms * 1e3 / layers, "tb_s": gb / ms, "max_err": err}
        best = min(row["grid"], key=lambda c: row["grid"][c]["us"])
        row.update(best=best, best_us=row["grid"][best]["us"])
        results[f"glu_rows{rows}"] = row
        print(f"gate_up {n}x{k} rows {rows:>2}: matmul + silu·mul {row['unfused_us']:.2f} us (matmul alone "
              f"{row['matmul_alone_us']:.2f}), glu picked {row['glu_picked_us']:.2f}, best {best} {row['best_us']:.2f} us",
              flush=True)
    print(write_record("glu-sweep", {"argv": sys.argv, "shape": shape}, results, out_dir))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[2] in ("sweep", "glu"):
        if len(sys.argv) > 4:
            ROWS = tuple(int(r) for r in sys.argv[4].split(","))
        (sweep if sys.argv[2] == "sweep" else glu_sweep)(sys.argv[1], sys.argv[3] if len(sys.argv) > 3 else "llama-3.1-8b")
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else "/tmp")
