#!/usr/bin/env bash
# The GPU runtime's checks and benchmarks on the H200 (issue 5); each phase fits one device call.
#   bash bench/gpu/runtime.sh test     # graphed == eager tokens, 20 MT-bench prompts, every drafter
#   bash bench/gpu/runtime.sh smollm2  # eaglet bench: all systems side by side on SmolLM2
#   bash bench/gpu/runtime.sh shapes   # eaglet bench --shape: Llama-3.1-8B and Qwen3-8B, random weights
#   bash bench/gpu/runtime.sh probes   # kernel choices (no model needed): cache-attention row tiles and splits,
#                                      # few-row matmul tiles (GEMV, dot, rows_gemv) for 2-16 rows, the tree's top-k
#   bash bench/gpu/runtime.sh eagle3   # the EAGLE-3 bar: plain, chain 5, tree on all 80 MT-bench prompts x 256 tokens
#                                      # (MAXNEW=128: 128 tokens a reply; the first 128 tokens are the harder half;
#                                      #  EOS=1: replies end at EOS, as eval-draft's τ and served replies do)
#                                      #  TREE=STEPS,TOPK,TOKENS: the tree measured, 6,8,32 by default)
# The model must be staged first (../shared/tools/stage-files --smollm2, see GPU.md).
phase=$1
source "$(dirname "$0")/setup.sh"
set +e
# each call writes its own folder: two phases at once (one per GPU) must not pack or remove each
# other's records (a shared folder lost a test's log that way)
out=${OUT:-/tmp}/records-$phase-$$
mkdir -p "$out"
case $phase in
  test)
    EAGLET_TEST_GGUF=$GGUF EAGLET_TEST_RECORD=$out/cuda-graphs-test-h200.json \
      python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py 2>&1 | tee "$out/cuda-graphs-test-h200.log" ;;
  smollm2)
    python3 -m eaglet bench --model $GGUF --draft ${DRAFT:-eaglet/drafters/smollm2-135m-instruct-eagle3} --prompts mtbench \
      --num-prompts ${PROMPTS:-5} --max-new-tokens ${MAXNEW:-128} --repeats 3 ${SYSTEMS:+--systems $SYSTEMS} --out "$out" ;;
  eagle3)
    python3 -m eaglet bench --model $GGUF --draft ${DRAFT:-eaglet/drafters/smollm2-135m-instruct-eagle3} --prompts mtbench \
      --num-prompts 80 --max-new-tokens ${MAXNEW:-256} --repeats 3 --systems plain eagle3-chain eagle3-tree ${TREE:+--tree $TREE} \
      ${EOS:+--stop-at-eos} --out "$out" ;;
  plan)  # issue 6 on the H200: profile, then plan with predicted vs measured for chains 1-7 and 2 trees
    python3 -m eaglet profile --model $GGUF --draft eaglet/drafters/smollm2-135m-instruct-eagle3 --num-prompts 8 \
      --max-new-tokens 128 --chain-steps 7 --trees 7,4,64 6,8,32 --context 256 --out "$out" &&
    python3 -m eaglet plan --profile "$(ls -t "$out"/profile-*.json | head -1)" --validate --validate-all ;;
  shapes)
    for s in ${SHAPES:-llama-3.1-8b qwen3-8b}; do
      python3 -m eaglet bench --shape $s --context 512 --max-new-tokens 128 --repeats 3 --out "$out"
    done ;;
  probes)
    here=$(dirname "$0")
    python3 "$here/cache_attention_probe.py" "$out" tiles > "$out/cache-attention-tiles.log" 2>&1
    python3 "$here/layer_probe.py" "$out" sweep smollm2-135m 2,4,6,8,16 > "$out/sweep-smollm2.log" 2>&1
    python3 "$here/layer_probe.py" "$out" sweep llama-3.1-8b 2,4,6,8 > "$out/sweep-llama.log" 2>&1
    python3 "$here/topk_probe.py" "$out" > "$out/topk.log" 2>&1
    grep -hv Warn "$out"/*.log | grep -v "^ " | tail -60 ;;
esac
rc=$?
# a call brings back at most 8 files: past 6, the records travel as one tarball (unpack with tar xzf)
if [ -n "${OUT:-}" ] && [ "$(ls "$out" | wc -l)" -gt 6 ]; then
  tgz="$OUT/records-$phase-$(date +%H%M%S).tgz"
  tar czf "$tgz" -C "$OUT" "$(basename "$out")" && rm -rf "$out" && echo "records packed into $tgz"
fi
exit $rc
