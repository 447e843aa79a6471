#!/usr/bin/env bash
# Issue 54 on the GPU: `--exact`, bitwise lossless in bfloat16. Each phase fits one device call; all but
# `test` need SmolLM2 staged first (../shared/tools/stage-files --smollm2, see GPU.md).
#   bash bench/gpu/exact.sh test   # the exact tests on the GPU: verify == decode bitwise, the kernels row-invariant
#   bash bench/gpu/exact.sh bar    # eaglet bench --exact: 80 MT-bench prompts x 256 tokens, chain, tree, n-gram vs plain
#                                  # (PROMPTS=N, MAXNEW=N to run fewer)
#   bash bench/gpu/exact.sh cost   # the cost: plain and EAGLE-3 chain with and without --exact, one process each,
#                                  # 10 prompts x 128 tokens, 3 repeats
#   bash bench/gpu/exact.sh serve  # `eaglet serve --exact`: the same 64 MT-bench requests one at a time and 64 at
#                                  # once, greedy (bench/serve_invariance.py; needs the fastapi, uvicorn and
#                                  # pydantic wheels in .whl, as bench/gpu/serve.sh says)
# Everything it writes lands in $OUT/exact-<phase>.tar.
phase=$1
source "$(dirname "$0")/setup.sh"
set +e
out=/tmp/records-exact-$phase-$$
mkdir -p "$out"
draft=eaglet/drafters/smollm2-135m-instruct-eagle3
case $phase in
  test)
    python3 -m pytest -q -p no:cacheprovider tests/test_exact.py tests/test_exact_attention.py tests/test_gemv.py \
      tests/test_quant.py -k "cuda or exact or gpu" 2>&1 | tee "$out/exact-test.log" ;;
  bar)
    python3 -m eaglet bench --model $GGUF --draft $draft --exact --prompts mtbench --num-prompts ${PROMPTS:-80} \
      --max-new-tokens ${MAXNEW:-256} --repeats 1 --systems plain eagle3-chain eagle3-tree ngram --out "$out" 2>&1 |
      tee "$out/exact-bar.log" ;;
  cost)
    for flag in "" --exact; do
      python3 -m eaglet bench --model $GGUF --draft $draft $flag --prompts mtbench --num-prompts 10 --max-new-tokens 128 \
        --repeats 3 --systems plain eagle3-chain --out "$out" 2>&1 | tee -a "$out/exact-cost.log"
    done ;;
  serve)
    # the server's log straight into $OUT: it comes back even when the call runs out of time. Warm-up
    # captures every prefill length up to the context: at the default 8192 it ran past 240 s on the H200
    # (nothing served); 1024 holds the MT-bench prompts and 128 new tokens. Give it a call of its own.
    python3 -m eaglet serve --model $GGUF --draft $draft --exact --port 8391 --max-batch 64 --max-model-len 1024 \
      > "${OUT:-$out}/serve.log" 2>&1 &
    pid=$!
    wait_health 8391 420 && python3 bench/serve_invariance.py --port 8391 --requests 64 --max-tokens 128 \
      --label "gpu bf16 exact" --out "$out" 2>&1 | tee "$out/exact-serve.log"
    kill $pid ;;
esac
tar -cf "${OUT:-/tmp}/exact-$phase.tar" -C "$out" .
