#!/usr/bin/env bash
# Issue 51 on the H200: the MoE layer kernels and the MoE shapes (random weights: nothing to stage).
#   bash bench/gpu/moe.sh layer   # eaglet bench-moe: every path against the touched-bytes floor
#                                 # (TUNE=1: sweep the fused tiles first; SHAPES="kimi-k2 qwen3-30b-a3b" by default;
#                                 #  QUANT="bf16 int4 fp8": the experts also as INT4 packs and FP8 blocks)
#   bash bench/gpu/moe.sh layer-ab  # the fused kernels of the package in $ALT (default .old) and of this checkout, one after
#                                 #  the other (SHAPES="qwen3-30b-a3b kimi-k2" by default; QUANT as for layer), records in alt/ and this/
#   bash bench/gpu/moe.sh test    # the MoE GPU tests: graphed == eager, the fused kernels row-invariant
#   bash bench/gpu/moe.sh mla     # the MLA attention kernel: its GPU tests (the kernel against the absorbed form,
#                                 #  a tiny DeepSeek-V3 through it), then decode and the forward curve side by side with
#                                 #  the package in $ALT (default .old: `git archive <sha> -- eaglet | tar -x -C .old`
#                                 #  here, carried), SHAPES="deepseek-v2-lite kimi-k2" by default (bench/gpu/decode_ab.py)
#   bash bench/gpu/moe.sh shapes  # eaglet bench --shape: plain decode against the touched-bytes roofline, the verify curve
#                                 # (SPEC="chain:1 chain:2 chain:3 chain:5 tree:4,4,16 tree:6,8,32": the speculation
#                                 #  settings timed; then `eaglet plan --shape S --gpu h200 --moe-record M --against R`)
# Everything it writes lands in $OUT/moe-<phase>/ as it is written (records, tiles, the log: a call cut
# short by its time limit still brings back what it had), or /tmp/moe-<phase>/ without $OUT.
# TUNE_TOKENS="1 16 64": the token counts the tile sweep scores (default: every measured count).
phase=$1
source "$(dirname "$0")/setup.sh"
set +e
out=${OUT:-/tmp}/moe-$phase
mkdir -p "$out"
case $phase in
  layer)
    python3 -m eaglet bench-moe --shape ${SHAPES:-kimi-k2 qwen3-30b-a3b} ${TUNE:+--tune} ${TUNE_TOKENS:+--tune-tokens $TUNE_TOKENS} --tiles-out "$out/moe_tiles.json" \
      --paths ${PATHS_:-fused grouped gathered} --quant ${QUANT:-bf16} --out "$out" 2>&1 | tee "$out/bench-moe.log" ;;
  layer-ab)  # the fused kernels from the package in $ALT (default .old), then from this checkout (with the grouped matmul)
    for side in alt this; do
      dir=${ALT:-.old} paths=fused; [ $side = this ] && dir=. paths="fused grouped"
      (cd $dir && python3 -m eaglet bench-moe --shape ${SHAPES:-qwen3-30b-a3b kimi-k2} --paths $paths --quant ${QUANT:-bf16} \
        --out "$out/$side") 2>&1 | tee -a "$out/bench-moe-ab.log"
    done ;;
  test)
    python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py tests/test_moe.py tests/test_quant.py -k "moe_graphed or gpu" 2>&1 | tee "$out/moe-test.log" ;;
  mla)
    python3 -m pytest -q -p no:cacheprovider tests/test_mla_attention.py tests/test_mla.py tests/test_lookahead.py \
      -k "absorbed or general_path or speculation_through or one_matmul or host_sync" 2>&1 | tee "$out/mla-test.log"
    shapes=${SHAPES:-deepseek-v2-lite kimi-k2}
    python3 bench/gpu/decode_ab.py "$out" "${shapes// /,}" "${ALT:-.old},." 2>&1 | tee "$out/decode-ab.log" ;;
  shapes)
    for s in ${SHAPES:-qwen3-30b-a3b deepseek-v2-lite mixtral-8x7b kimi-k2}; do
      python3 -m eaglet bench --shape $s --context 512 --max-new-tokens 128 --repeats 3 ${SPEC:+--spec-settings $SPEC} \
        --out "$out" 2>&1 | tee -a "$out/bench-shape.log"
    done ;;
esac
