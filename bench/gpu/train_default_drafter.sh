#!/usr/bin/env bash
# How the bundled SmolLM2-135M-Instruct EAGLE-3 drafter is made, on one H200, in phases that each fit
# one device call (10 min); /tmp persists between back-to-back calls, and every phase resumes.
#   bash bench/gpu/train_default_drafter.sh prepare # HERE, not on the GPU: the ShareGPT user turns
#                                                   # into .gpudata/ (the 125 MB package cannot travel)
#   bash bench/gpu/train_default_drafter.sh data    # regenerate ShareGPT replies with the target
#   bash bench/gpu/train_default_drafter.sh train   # EAGLE-3 TTT training, export to /tmp/train/drafter
#   bash bench/gpu/train_default_drafter.sh eval    # τ on MT-bench and HumanEval, chain and tree
#   bash bench/gpu/train_default_drafter.sh fetch   # the export into $OUT, split into 15 MB parts
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
set +e
TRAIN_ARGS="--model $GGUF --dtype bfloat16 --data /tmp/data --out /tmp/train --lr ${LR:-5e-4} --batch-tokens ${BATCH_TOKENS:-32768}
  --max-len 1024 --draft-vocab 16384 --save-every 200"
case $phase in
  data)
    # The GPU machine cannot receive the 125 MB ShareGPT package: `prepare` keeps its conversations'
    # user turns (what `eaglet data` uses), ids kept, so the held-out split is the same; they travel
    # staged with the model: ../shared/tools/stage-files --smollm2 .gpudata/sharegpt_user_turns.json.gz
    # (The first drafter, committed 2026-11-29 morning, used TURNS=first, float32, --batch 384.)
    turns=/tmp/stage/sharegpt_user_turns.json.gz; [ -f $turns ] || turns=.gpudata/sharegpt_user_turns.json.gz
    [ -f /tmp/sharegpt.json ] || gunzip -c $turns > /tmp/sharegpt.json
    time timeout ${DATA_SECONDS:-500} python3 -m eaglet data --model $GGUF --dtype bfloat16 --out /tmp/data \
      --source /tmp/sharegpt.json --turns ${TURNS:-all} \
      --batch ${BATCH:-1024} --max-new-tokens 320 --max-prompt-tokens 512 --shard-size 2048
    ls /tmp/data | wc -l ;;
  train)
    # Epochs: from a 12-step throughput probe, as many as fit TRAIN_SECONDS in all (the cosine
    # schedule spans them); each call trains at most CALL_SECONDS, then checkpoints and exports.
    mkdir -p /tmp/train ${OUT:-/tmp}/records
    if [ ! -f /tmp/train/epochs ]; then
      python3 -m eaglet train-draft $TRAIN_ARGS --out /tmp/probe --epochs 1 --max-steps 12 --save-every 1000 \
        | tail -2 | head -1 > /tmp/probe.json
      python3 - <<'PY' > /tmp/train/epochs
import json, os
from eaglet.train.regen import read_shards
tps = json.load(open("/tmp/probe.json"))["tokens_per_s"]
tokens = sum(min(len(r["input_ids"]), 1024) - r["prompt_len"] for r in read_shards("/tmp/data"))
epochs = max(0.5, min(8.0, float(os.environ.get("TRAIN_SECONDS", "900")) * tps / tokens))
print(f"{epochs:.1f}")
import sys; print(f"probe {tps:.0f} assistant tokens/s; {tokens} tokens an epoch; {epochs:.1f} epochs", file=sys.stderr)
PY
    fi
    python3 -m eaglet train-draft $TRAIN_ARGS --epochs $(cat /tmp/train/epochs) --time-limit ${CALL_SECONDS:-500} \
      --out /tmp/train
    cp /tmp/train/*.json ${OUT:-/tmp}/records/ ;;
  eval)
    for set in mtbench humaneval; do
      python3 -m eaglet eval-draft --model $GGUF --dtype float32 --draft /tmp/train/drafter --prompts $set \
        --max-new-tokens 256 --batch 200 --settings chain:5 chain:7 tree:5,4,16 tree:6,8,32 --out ${OUT:-/tmp}/records
    done ;;
  fetch)  # the export back through $OUT (files of at most 16 MiB): split, joined again here with cat
    mkdir -p ${OUT:-/tmp}/drafter && cp /tmp/train/drafter/config.json ${OUT:-/tmp}/drafter/ &&
      split -b 15M /tmp/train/drafter/model.safetensors ${OUT:-/tmp}/drafter/model.safetensors.part- ;;
esac
