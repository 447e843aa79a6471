"""The kernels and tile choices that tests/test_triton_compile.py compiles for the H200 (sm_90).
Run in a process of its own: Triton's interpreter (which conftest turns on for the other tests)
replaces every @triton.jit function, and the compiler needs the real ones."""
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from eaglet.models import cache_attention as ca
from eaglet.models import exact, exact_attention, fused_moe, gemv, mla_attention, mla_heads, moe_route
from eaglet import cut_draw
from eaglet.spec import topk

H200 = GPUTarget("cuda", 90, 32)
TYPES = {"X": "*bf16", "W": "*bf16", "B": "*bf16", "Y": "*bf16", "QKV": "*bf16", "K": "*bf16", "V": "*bf16",
         "OUT": "*bf16", "R": "*bf16", "S": "*bf16", "COS": "*bf16", "SIN": "*bf16", "QW": "*bf16", "KW": "*bf16", "START": "*i64", "MASK": "*i1",
         "PM": "*fp32", "PL": "*fp32", "PO": "*fp32", "eps": "fp32", "scale": "fp32",
         "x_ptr": "*bf16", "val_ptr": "*fp32", "idx_ptr": "*i64", "off_ptr": "*fp32",
         "part_v": "*fp32", "part_i": "*i64", "stats": "*fp32", "QL": "*bf16", "QP": "*bf16", "KV": "*bf16",
         "CACHE": "*bf16"}


def compile_for_h200(fn, const: dict, warps: int = 4, stages: int = 3, types: dict | None = None) -> bytes:
    """fn to a cubin for sm_90 (returned): the constexprs given, pointers and floats typed by name
    (`types`, then TYPES), every other argument a 32-bit int."""
    types = {**TYPES, **(types or {})}
    sig = {p.name: "constexpr" if p.name in const else types.get(p.name, "i32") for p in fn.params}
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=H200,
                            options={"num_warps": warps, "num_stages": stages})
    assert kernel.asm["cubin"]
    return kernel.asm["cubin"]


def cases():
    """(name, thunk) for each kernel at the tiles the package picks for SmolLM2, the 8B shapes and the
    2048-wide MoE shapes."""
    for n, k, glu in [(49152, 576, False), (1536, 576, True), (4096, 4096, False), (14336, 4096, True),
                      (5120, 2048, False), (151936, 2048, False)]:
        bn, bk, warps = gemv.glu_tiles(1, k) if glu else gemv.tiles(n, k)
        pre = min(gemv.PRE_SLICES, -(-k // bk))  # launched dependent on sm_90: slices read before waiting
        yield (f"gemv one row, {n} x {k}, glu {glu}, {pre} slices first",
               lambda k=k, glu=glu, bn=bn, bk=bk, w=warps, pre=pre: compile_for_h200(
                   gemv.gemv_kernel, dict(K=k, BN=bn, BK=bk, EVEN_K=k % bk == 0, HAS_BIAS=False, GLU=glu, TRIGGER=True,
                                          PRE=pre), w))
    for rows, n, k, glu, bias in [(6, 576, 576, False, True), (16, 3072, 576, True, False),
                                  (16, 4096, 4096, False, False), (2, 28672, 4096, True, False)]:
        bm, bn, bk, warps, stages = gemv.glu_tiles(rows, k) if glu else gemv.dot_tiles(rows, n, k)
        yield (f"gemv {rows} rows, {n} x {k}, glu {glu}",
               lambda k=k, glu=glu, bias=bias, t=(bm, bn, bk), w=warps, s=stages: compile_for_h200(
                   gemv.gemv_dot_kernel, dict(K=k, BM=t[0], BN=t[1], BK=t[2], EVEN_K=k % t[2] == 0, HAS_BIAS=bias, GLU=glu,
                                              TRIGGER=True, PRE=1),
                   w, s))
    for t, tree, split, norm in [(1, False, False, False), (6, False, True, False), (16, True, False, False),
                                 (32, True, True, True)]:
        g, hkv, d = 3, 3, 64
        rows, tiles = ca.row_tiles(g, t, hkv)
        const = dict(H=g * hkv, HKV=hkv, G=g, TILES=tiles, ROWS=rows, TP=max(16, ca.pow2(t)), PP=16, D=d, BLOCK=64,
                     TREE=tree, SPLIT=split, ROPE=True, QK_NORM=norm)
        yield f"cache attention, {t} tokens, tree {tree}, split {split}", lambda c=const: compile_for_h200(ca.attend_kernel, c)
        if split:
            yield f"cache attention combine, {t} tokens", lambda r=rows, n=tiles: compile_for_h200(
                ca.combine_kernel, dict(G=3, TILES=n, ROWS=r, D=64, SP=8, TRIGGER=True))
    for nh, t, pending, tree, split in [(16, 1, 0, False, False), (128, 1, 0, False, True), (16, 16, 0, True, True),
                                        (16, 8, 16, True, False)]:  # DeepSeek-V2-Lite's and V3's heads, 512 + 64
        const = dict(NH=nh, C=512, R=64, RP=64, ROWS=mla_attention.ROWS, TP=max(16, ca.pow2(t)), PP=max(16, ca.pow2(pending)),
                     BLOCK=mla_attention.BLOCK, CK=mla_attention.CHUNK, TREE=tree, SPLIT=split, INTERLEAVED=True)
        yield (f"MLA attention, {nh} heads, {t} tokens, {pending} pending, split {split}",
               lambda c=const: compile_for_h200(mla_attention.mla_kernel, c, 8))
    const = dict(ROW=256 * 512, D=128, C=512, PDL=True)  # DeepSeek's per-head matmuls at one token
    yield "MLA absorb", lambda: compile_for_h200(mla_heads.absorb_kernel, {**const, "BC": mla_heads.ABSORB_COLS}, 4)
    yield "MLA values", lambda: compile_for_h200(mla_heads.values_kernel, {**const, "BV": mla_heads.VALUE_ROWS}, 4,
                                                types={"V": "i32"})
    bm, bn, bk, warps, stages = gemv.exact_tiles(49152, 576, False)  # the exact path: SmolLM2's head too
    yield "exact matmul, 49152 x 576", lambda: compile_for_h200(
        gemv.gemv_dot_kernel, dict(K=576, BM=bm, BN=bn, BK=bk, EVEN_K=576 % bk == 0, HAS_BIAS=False, GLU=False,
                                   TRIGGER=False, PRE=0),
        warps, stages)
    for add in (False, True):
        yield f"RMSNorm, residual {add}, dependent launch {add}", lambda add=add: compile_for_h200(
            exact.rms_norm_kernel, dict(BLOCK=1024, ADD=add, GDC=add), 4)
    for g, t, tree, norm in [(3, 1, False, False), (8, 16, True, True)]:
        yield f"exact attention, {t} tokens, tree {tree}", lambda g=g, t=t, tree=tree, norm=norm: compile_for_h200(
            exact_attention.attend_kernel, dict(G=g, ROWS=16, E=max(16, ca.pow2(t)), D=128, SPLIT=exact_attention.SPLIT,
                                                BLOCK=exact_attention.BLOCK, TREE=tree, ROPE=True, QK_NORM=norm))
    yield "exact attention store", lambda: compile_for_h200(
        exact_attention.store_kernel, dict(H=32, HKV=4, TP=16, D=128, ROPE=True, QK_NORM=True))
    yield "exact attention combine", lambda: compile_for_h200(exact_attention.combine_kernel, dict(G=8, ROWS=16, D=128))
    moe = {"K": "i32", "x": "*bf16", "act": "*bf16", "experts": "*i64", "touched": "*i32", "forwards": "*i32", "wt": "*fp32",
           "y": "*fp32", "out": "*bf16", "add": "*bf16", "w2": "*bf16"}
    # the shared experts folded in as extra pairs: DeepSeek-V2-Lite's two chunks, bfloat16 only
    for quant, w, ws, group, shared in [(0, "*bf16", "*bf16", 1, 0), (4, "*i32", "*bf16", 32, 0),
                                        (8, "*fp8e4nv", "*fp32", 128, 0), (0, "*bf16", "*bf16", 1, 2)]:
        t = fused_moe.Tiles(gate_cols=32, gate_step=256, down_cols=64, down_step=256)  # Kimi-K2's, as tuned
        yield f"fused MoE gate-up, quant {quant}, shared {shared}", lambda q=quant, w=w, ws=ws, g=group, sh=shared: compile_for_h200(
            fused_moe.gate_up_kernel, dict(QUANT=q, GROUP=g, PAIRS=128, BI=t.gate_cols, SPAN=t.spans()[0], BH=t.gate_step,
                                           CHUNK=fused_moe.CHUNK, COUNT=True, SHARED=sh, GDC=True), 4, 3, {**moe, "w": w, "ws": ws})
        for pre in (0, 1) if quant == 0 else (1,):  # down_pre: the first step's weights read before the wait
            yield f"fused MoE down, quant {quant}, pre {pre}, shared {shared}", \
                lambda q=quant, w=w, ws=ws, g=group, pre=pre, sh=shared: compile_for_h200(
                    fused_moe.down_kernel, dict(QUANT=q, GROUP=g, PAIRS=128, BHO=t.down_cols, SPAN=t.spans()[1],
                                                BI=t.down_step, CHUNK=fused_moe.CHUNK, PRE=pre, SHARED=sh, GDC=True), 4, 3,
                    {**moe, "w": w, "ws": ws})
    yield "fused MoE combine", lambda: compile_for_h200(fused_moe.combine_kernel, dict(K=8, BLOCK=1024, ADD=True,
                                                                                      GDC=True), 4, 3, moe)
    route = {"X": "*bf16", "bias": "*fp32", "logits": "*fp32", "counts": "*i32", "experts": "*i64", "weights": "*fp32",
             "scaling": "fp32", "NW": "*bf16", "XN": "*bf16", "XS": "*bf16"}
    # the routers as the shapes run them: a bfloat16 router rounded as its matmul, or DeepSeek-V3's float32 sigmoid one;
    # with the post-attention norm inside (PRENORM: one and two tokens) and without
    for name, e, k, groups, v3 in [("Qwen3-30B-A3B", 128, 8, 1, False), ("DeepSeek-V2-Lite", 64, 6, 1, False),
                                   ("Kimi-K2", 384, 8, 1, True), ("DeepSeek-V3", 256, 8, 8, True)]:
        be, bk = moe_route.router_tiles(e, 7168 if v3 else 2048)
        for pre in (False, True):
            yield f"MoE routing, {name}" + (", the norm inside" if pre else ""), \
                lambda e=e, k=k, gr=groups, v3=v3, be=be, bk=bk, pre=pre: compile_for_h200(
                    moe_route.router_kernel, dict(GDC=pre, PRENORM=pre, BE=be, BK=bk, ROUND=not v3, EP=ca.pow2(e), K=k, KP=ca.pow2(k),
                                                  GP=max(1, ca.pow2(gr)), GROUPS=gr, TOPK_GROUP=min(gr, 4), SIGMOID=v3, BIAS=v3,
                                                  GROUP_TOP2=v3, NORM=True, SPREAD=False), 4, 3,
                    {**route, "W": "*fp32" if v3 else "*bf16"})
    for k, width, ls, off in [(8, 16384, True, True), (4, 16, False, False), (31, 328, False, False)]:
        block = max(16, ca.pow2(width))
        yield f"row top-{k} of {width}", lambda k=k, b=block, ls=ls, off=off: compile_for_h200(
            topk.row_topk_kernel, dict(K=k, BLOCK=b, LOG_SOFTMAX=ls, OFFSET=off), min(16, max(1, b // 1024)))
    # a 16,384-wide row in 16 pieces; sampling.argmax: k = 1 over SmolLM2's 49,152 in 48
    for k, ls, off, pieces in [(4, True, True, 16), (8, True, False, 16), (4, False, False, 16), (1, False, False, 48)]:
        yield f"top-{k} of pieces", lambda k=k, ls=ls: compile_for_h200(
            topk.chunk_topk_kernel, dict(K=k, CHUNK=topk.CHUNK, LOG_SOFTMAX=ls))
        yield f"top-{k} merge of {pieces}", lambda k=k, ls=ls, off=off, n=pieces: compile_for_h200(
            topk.merge_topk_kernel, dict(K=k, BLOCK=max(16, ca.pow2(n * k)), CB=max(16, ca.pow2(n)), LOG_SOFTMAX=ls,
                                         OFFSET=off), 1)
    draw = {"x_ptr": "*bf16", "t_ptr": "*fp32", "k_ptr": "*i64", "p_ptr": "*fp32", "seed_ptr": "*i64", "ids_ptr": "*i64",
            "out_ptr": "*i64", "hist_ptr": "*i32", "floor_ptr": "*i32", "part_ptr": "*fp32"}
    yield "sampled draw under top-k / top-p", lambda: compile_for_h200(
        cut_draw.cut_draw_kernel, dict(LEVELS=2, BLOCK=cut_draw.BLOCK), cut_draw.WARPS, 3, draw)
    s_pow = ca.pow2(-(-49152 // cut_draw.SLICE))  # SmolLM2's vocabulary in slices, as the package runs it
    tile = dict(S_POW=s_pow, SLICE=cut_draw.SLICE)
    for level in range(2):
        yield f"sampled draw over slices: radix byte {level}", lambda level=level: compile_for_h200(
            cut_draw.kth_part_kernel, dict(tile, LEVEL=level), cut_draw.SLICE_WARPS, 3, draw)
    yield "sampled draw over slices: best", lambda: compile_for_h200(
        cut_draw.best_part_kernel, dict(tile, LEVELS=2), cut_draw.SLICE_WARPS, 3, draw)
    for round_ in range(cut_draw.ROUNDS):
        yield f"sampled draw over slices: nucleus check {round_}", lambda round_=round_: compile_for_h200(
            cut_draw.nucleus_part_kernel, dict(tile, ROUND=round_), cut_draw.SLICE_WARPS, 3, draw)
    yield "sampled draw over slices: finish", lambda: compile_for_h200(
        cut_draw.finish_kernel, dict(S_POW=s_pow, ROUNDS=cut_draw.ROUNDS, BLOCK=cut_draw.BLOCK), cut_draw.WARPS, 3, draw)


def main() -> int:
    failed = 0
    for name, run in cases():
        try:
            run()
            print("ok", name)
        except Exception as e:  # report every kernel, then fail
            failed += 1
            print("FAILED", name, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
    return failed


if __name__ == "__main__":
    sys.exit(1 if main() else 0)
