#!/usr/bin/env bash
# Two versions of eaglet measured side by side in one device call (the H200 is shared and noisy:
# figures from two calls are not a comparison). The other version is a copy of an earlier commit's
# package, carried with the call:
#   git archive SHA eaglet | tar -x -C .prev && rm .prev/eaglet/drafters/*/model.safetensors
#   (.prev git-ignored locally, e.g. in .git/info/exclude; carry: [".prev", ".whl", ".stage/pN"])
#   PREV_SHA=SHA EAGLET_GIT_SHA=HEAD bash bench/gpu/side_by_side.sh smollm2|shape
# smollm2: `eaglet bench` on SmolLM2, plain, EAGLE-3 chain 5 and tree 5,4,16, 20 MT-bench prompts x
#          128 tokens, 3 repeats (the bundled drafter of this checkout for both versions);
# shape:   `eaglet bench --shape llama-3.1-8b`: plain decode against the roofline and the verify curve.
# The versions alternate, this checkout first; each writes its own records (the flags and
# environment name the commit) into $OUT/records-side-<phase>-$$.
set -euo pipefail
phase=$1
source "$(dirname "$0")/setup.sh"
out=${OUT:-/tmp}/records-side-$phase-$$
mkdir -p "$out"
draft=$PWD/eaglet/drafters/smollm2-135m-instruct-eagle3
run() {  # run DIR SHA ARGS...: eaglet from DIR, records naming SHA
  local dir=$1 sha=$2
  shift 2
  (cd "$dir" && EAGLET_GIT_SHA=$sha PYTHONPATH=/tmp/site:$PWD python3 -m eaglet bench "$@" --out "$out")
}
for who in new old; do
  if [ $who = new ]; then dir=$PWD sha=$EAGLET_GIT_SHA; else dir=$PWD/.prev sha=$PREV_SHA; fi
  case $phase in
    smollm2)
      run "$dir" "$sha" --model "$GGUF" --draft "$draft" --prompts mtbench --num-prompts 20 --max-new-tokens 128 \
        --repeats 3 --systems plain eagle3-chain eagle3-tree --chain-steps 5 --tree 5,4,16 ;;
    shape)
      run "$dir" "$sha" --shape llama-3.1-8b --context 512 --max-new-tokens 128 --repeats 3 ;;
  esac
done
ls "$out"
