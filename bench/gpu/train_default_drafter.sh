#!/usr/bin/env bash
# How the bundled SmolLM2-135M-Instruct EAGLE-3 drafter is made, on one H200, in phases that each fit
# one device call (10 min); /tmp persists between back-to-back calls, and every phase resumes.
#   bash bench/gpu/train_default_drafter.sh prepare # HERE, not on the GPU: the ShareGPT user turns
#                                                   # into .gpudata/ (the 125 MB package cannot travel)
#   bash bench/gpu/train_default_drafter.sh data    # regenerate ShareGPT replies with the target
#   bash bench/gpu/train_default_drafter.sh train   # EAGLE-3 TTT training, export to /tmp/train/drafter
#   bash bench/gpu/train_default_drafter.sh eval    # τ on MT-bench and HumanEval, chain and tree
phase=$1
if [ "$phase" = prepare ]; then
  mkdir -p .gpudata && grep -qx '/.gpudata/' .git/info/exclude || echo '/.gpudata/' >> .git/info/exclude
  .venv/bin/python - <<'PY'
import gzip, json
from eaglet.datasets import read_sharegpt, human_turns
convs = [{"id": c.get("id", str(i)), "conversations": [{"from": "human", "value": t} for _, t in human_turns(c)]}
         for i, c in enumerate(read_sharegpt().conversations)]
with gzip.open(".gpudata/sharegpt_user_turns.json.gz", "wt") as f:
    json.dump([c for c in convs if c["conversations"]], f)
PY
  exit 0
fi
source "$(dirname "$0")/setup.sh"
case $phase in
  data)
    # The GPU machine cannot receive the 125 MB ShareGPT package: .gpudata carries its conversations'
    # user turns (what `eaglet data` uses), ids kept, so the held-out split is the same.
    # (The first drafter, committed 2026-11-29, used TURNS=first with --batch 384.)
    [ -f /tmp/sharegpt.json ] || gunzip -c .gpudata/sharegpt_user_turns.json.gz > /tmp/sharegpt.json
    timeout ${DATA_SECONDS:-500} python3 -m eaglet data --model $GGUF --dtype float32 --out /tmp/data \
      --source /tmp/sharegpt.json --turns ${TURNS:-all} \
      --batch ${BATCH:-1024} --max-new-tokens 320 --max-prompt-tokens 512 --shard-size 2048 || true
    ls /tmp/data | wc -l ;;
  train)
    python3 -m eaglet train-draft --model $GGUF --dtype float32 --data /tmp/data --out /tmp/train \
      --epochs ${EPOCHS:-4} --lr ${LR:-3e-4} --batch-tokens 32768 --max-len 1024 --draft-vocab 16384 \
      --save-every 100 ;;
  eval)
    for set in mtbench humaneval; do
      python3 -m eaglet eval-draft --model $GGUF --dtype float32 --draft /tmp/train/drafter --prompts $set \
        --max-new-tokens 256 --batch 200 --settings chain:5 chain:7 tree:5,4,16 tree:6,8,32 --out ${OUT:-/tmp}/records
    done ;;
esac
