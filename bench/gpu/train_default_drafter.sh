#!/usr/bin/env bash
# How the bundled SmolLM2-135M-Instruct EAGLE-3 drafter is made, on one H200, in phases that each fit
# one device call (10 min); /tmp persists between back-to-back calls, and every phase resumes.
#   bash bench/gpu/train_default_drafter.sh prepare # HERE, not on the GPU: the ShareGPT user turns
#                                                   # into .gpudata/ (the 125 MB package cannot travel)
#   bash bench/gpu/train_default_drafter.sh data    # regenerate ShareGPT replies with the target
#   bash bench/gpu/train_default_drafter.sh train   # EAGLE-3 TTT training in 4 stages, export to /tmp/train/drafter
#   bash bench/gpu/train_default_drafter.sh eval    # τ on MT-bench and HumanEval, chain and tree
#   bash bench/gpu/train_default_drafter.sh fetch   # the export into $OUT, split into 15 MB parts
# A fifth stage fine-tunes the bundled drafter on the prompts it never saw (shards 19..27):
#   bash bench/gpu/train_default_drafter.sh more      # their replies, greedy and sampled at T 0.8
#   bash bench/gpu/train_default_drafter.sh finetune  # --init-from the bundled drafter, then eval, fetch
# A sixth, over every turn (55.7k prompts), each phase resumable across back-to-back calls:
#   TEMPS="0 0.8" bash bench/gpu/train_default_drafter.sh all  # greedy replies, then sampled at T 0.8:
#       one 10-minute call writes all 28 greedy shards and about 15 of the 28 sampled ones
#   bash bench/gpu/train_default_drafter.sh alltrain  # one epoch over every /tmp/all-t* (~6 min), then eval, fetch
# Stages 7-9 (on the 2-GPU machine; in the bundled lineage) train on
# data stage 6 never saw: user turns the target writes itself (`eaglet data --self-prompts`, Magpie)
# and the 13 sampled shards stage 6 lacked, written on both GPUs at once:
#   CUDA_VISIBLE_DEVICES=0 bash bench/gpu/train_default_drafter.sh self &  # 30720 turns + greedy replies
#   (CUDA_VISIBLE_DEVICES=1 TEMPS=0.8 FIRST_SHARD=15 bash bench/gpu/train_default_drafter.sh all
#    CUDA_VISIBLE_DEVICES=1 FIRST_SHARD=15 SELF_PROMPTS=61440 bash bench/gpu/train_default_drafter.sh self) & wait
#   NPROC=2 bash bench/gpu/train_default_drafter.sh alltrain                     # stage 7, from stage 6
#   K=8 INIT=/tmp/train7/drafter EPOCHS=1.6 NPROC=2 bash bench/gpu/train_default_drafter.sh alltrain
#   K=9 INIT=/tmp/train8/drafter EPOCHS=1 NPROC=2 bash bench/gpu/train_default_drafter.sh alltrain
# each followed by `SETS=mtbench ... eval` and `SETS=humaneval ... eval` (one per GPU), `fetch`.
#   bash bench/gpu/train_default_drafter.sh profile  # a training step's kernels, phase by phase
#   START=30 bash bench/gpu/train_default_drafter.sh self2  # 30 more self-written shards, both GPUs
# Data outlives the machine: `pack` returns the /tmp/all-t* shards
# through $OUT as xz parts; here they are joined into .gpudata/, staged with the model next time
# (../shared/tools/stage-files --smollm2 .gpudata/sharegpt_user_turns.json.gz .gpudata/data-*.tar.xz)
# and `unpack` puts them back in /tmp, so a call trains instead of writing the same data again:
#   DIRS="all-tself30 all-tself45" NAME=self30-59 bash bench/gpu/train_default_drafter.sh pack
#   cat /work/.device/.../data/*.part-* > .gpudata/data-self30-59.tar.xz  # here
#   bash bench/gpu/train_default_drafter.sh unpack   # there, after staging
# Stages 10-12 (in the bundled lineage), on 61,440 new
# self-written turns (shards 30-59, kept as .gpudata/data-self30-59.tar.xz), from stage 9:
#   (CUDA_VISIBLE_DEVICES=1 FIRST_SHARD=45 SELF_PROMPTS=122880 BATCH=2048 bash ... self) &
#   (CUDA_VISIBLE_DEVICES=0 FIRST_SHARD=30 SELF_PROMPTS=92160 BATCH=2048 bash ... self) & wait  # ~5 min
#   K=10 EPOCHS=2 NPROC=2 bash bench/gpu/train_default_drafter.sh alltrain
#   K=11 INIT=/tmp/train10/drafter EPOCHS=2 NPROC=2 bash bench/gpu/train_default_drafter.sh alltrain
#   CUDA_VISIBLE_DEVICES=1 K=12 INIT=/tmp/train11/drafter EPOCHS=1 bash bench/gpu/train_default_drafter.sh alltrain
# Stages 14-16 (in the bundled lineage), on 61,440
# new self-written turns (shards 60-89, kept as .gpudata/data-self60-89.tar.xz), from stage 12:
#   (CUDA_VISIBLE_DEVICES=0 FIRST_SHARD=60 SELF_PROMPTS=153600 BATCH=2048 bash ... self) &
#   (CUDA_VISIBLE_DEVICES=1 FIRST_SHARD=75 SELF_PROMPTS=184320 BATCH=2048 bash ... self) & wait  # ~5 min
#   CUDA_VISIBLE_DEVICES=0 K=14 TEMP=0 EPOCHS=1 bash ... alltrain &  # hard labels (the A/B; not kept)
#   CUDA_VISIBLE_DEVICES=1 K=15 EPOCHS=1 bash ... alltrain & wait    # the target's distribution
#   K=16 INIT=/tmp/train15/drafter EPOCHS=2 NPROC=2 bash bench/gpu/train_default_drafter.sh alltrain
# each followed by eval-draft of /tmp/trainK/drafter on mtbench and humaneval (as `eval` runs it).
# Stage 17 (not bundled: +0.016 / +0.020 τ), after `unpack` of shards 60-89:
#   CUDA_VISIBLE_DEVICES=1 FIRST_SHARD=90 SELF_PROMPTS=215040 BATCH=2048 bash ... self  # kept as data-self90-104
#   K=17 EPOCHS=1 NPROC=2 bash bench/gpu/train_default_drafter.sh alltrain   # from stage 16, shards 60-104
# Stages 18-20 (one H200; in the bundled lineage):
# self-written turns that start with the built-in task openings (`eaglet data --prompt-openers tasks`),
# shards 105-134 (kept as .gpudata/data-open105-119.tar.xz and data-open120-134.tar.xz), from stage 16:
#   FIRST_SHARD=105 SELF_PROMPTS=245760 BATCH=2048 OPENERS=tasks bash ... self      # 3 min 45 s
#   K=18 EPOCHS=2 DATA=/tmp/all-topenself105 bash ... alltrain; bash ... eval
#   FIRST_SHARD=120 SELF_PROMPTS=276480 BATCH=2048 OPENERS=tasks bash ... self      # 3 min 35 s
#   cp -r /tmp/train18/drafter /tmp/drafter18
#   K=19 INIT=/tmp/drafter18 EPOCHS=1 DATA="/tmp/all-topenself105 /tmp/all-topenself120" bash ... alltrain; bash ... eval
#   K=20 INIT=/tmp/train19/drafter EPOCHS=1 DATA="/tmp/all-topenself105 /tmp/all-topenself120" bash ... alltrain; bash ... eval
# Stages 21-22 (one H200; in the bundled lineage): 61,440 new
# turns that start with the built-in openings and 66 more (bench/gpu/openers-more.txt), shards 135-164 (kept as
# .gpudata/data-open135-164.tar.xz), from stage 20:
#   FIRST_SHARD=135 SELF_PROMPTS=337920 BATCH=2048 OPENERS="tasks bench/gpu/openers-more.txt" DATA_SECONDS=520 bash ... self  # 8 min 40 s
#   K=21 EPOCHS=2 DATA=/tmp/all-topenself135 bash ... alltrain; bash ... eval
#   K=22 INIT=/tmp/train21/drafter EPOCHS=1 DATA=/tmp/all-topenself135 bash ... alltrain; bash ... eval
# Stage 23 (one H200; in the bundled lineage): 122,880 new
# turns with the same openings, shards 165-224 (kept as .gpudata/data-open165-224.tar.xz), from stage 22:
#   FIRST_SHARD=165 SELF_PROMPTS=460800 BATCH=2048 OPENERS="tasks bench/gpu/openers-more.txt" DATA_SECONDS=555 bash ... self  # 6 min 31 s
#   K=23 EPOCHS=2 DATA=/tmp/all-topenself165 TRAIN_SECONDS=525 bash ... alltrain  # twice: 525 s, then the last 188 s
#   bash ... fetch; bash ... eval
# Stages 24-26 (one H200; in the bundled lineage), from stage 23:
#   bash ... unpack   # shards 165-224, staged from .gpudata/data-open165-224.tar.xz
#   FIRST_SHARD=225 SELF_PROMPTS=583680 ... DATA_SECONDS=540 bash ... self &      # beside training: ran out of
#   K=24 EPOCHS=1 DATA=/tmp/all-topenself165 TRAIN_SECONDS=500 bash ... alltrain   # GPU memory after 2 shards
#   FIRST_SHARD=225 SELF_PROMPTS=522240 BATCH=2048 OPENERS="tasks bench/gpu/openers-more.txt" DATA_SECONDS=400 bash ... self
#   (DRAFT=/tmp/train24/drafter bash ... eval, beside it); kept as .gpudata/data-open225-254.tar.xz
#   K=25 INIT=/tmp/train24/drafter EPOCHS=2 DATA=/tmp/all-topenself225 TRAIN_SECONDS=420 bash ... alltrain; fetch; eval
#   K=26 INIT=/tmp/train25/drafter EPOCHS=1 DATA=/tmp/all-topenself225 bash ... alltrain; SETS=mtbench ... eval  # not kept
# Stage 27 (one H200; in the bundled lineage), from stage 25,
# 102,400 new turns, shards 255-304 (kept as .gpudata/data-open255-304.tar.xz), batches from 4096-row length windows:
#   FIRST_SHARD=255 SELF_PROMPTS=675840 BATCH=2048 OPENERS="tasks bench/gpu/openers-more.txt" DATA_SECONDS=330 bash ... self
#   export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True   # the trainer holds ~29 GiB instead of 100-124
#   K=127 EPOCHS=2 DATA=/tmp/all-topenself255 TRAIN_SECONDS=75 bash ... alltrain   # window 256: a 75 s control, not kept
#   K=27 EPOCHS=2 WINDOW=4096 BATCH_TOKENS=20480 DATA=/tmp/all-topenself255 TRAIN_SECONDS=75 bash ... alltrain
#   (the same again with TRAIN_SECONDS=320, then 300: three calls); bash ... fetch; bash ... eval
# Stages 28-29 (one H200; in the bundled lineage), from
# stage 27, with 40 more openings aimed at STEM and writing:
#   O="tasks bench/gpu/openers-more.txt bench/gpu/openers-stem.txt"
#   FIRST_SHARD=305 SELF_PROMPTS=$((355*2048)) BATCH=2048 OPENERS="$O" DATA_SECONDS=330 bash ... self  # 305-343
#   K=28 INIT=eaglet/drafters/smollm2-135m-instruct-eagle3 EPOCHS=2 WINDOW=4096 BATCH_TOKENS=20480 \
#     DATA=/tmp/all-topenself305 TRAIN_SECONDS=520 FIRST_SHARD=344 SELF_PROMPTS=$((420*2048)) BATCH=2048 \
#     OPENERS="$O" DATA_SECONDS=555 bash ... round   # the data job ran out of memory under DATA_CAP=40
#   bash ... fetch; MEM_CAP=90 FIRST_SHARD=344 SELF_PROMPTS=$((420*2048)) BATCH=2048 OPENERS="$O" \
#     DATA_SECONDS=420 bash ... self &  DRAFT=/tmp/train28/drafter bash ... eval; wait   # 344-399
#   DIRS=all-topenself344 NAME=open344 bash ... pack   # kept as .gpudata/data-open344.tar.xz
#   K=29 INIT=/tmp/train28/drafter EPOCHS=0.75 WINDOW=4096 BATCH_TOKENS=20480 DATA=/tmp/all-topenself344 \
#     TRAIN_SECONDS=320 bash ... alltrain; bash ... fetch   # evaluated on the CPU
# Stages 30-32 (one H200; in the bundled lineage), from
# stage 29: its draft vocabulary re-chosen from shards 344-399 (18,432 ids) against the same training without:
#   ../shared/tools/stage-files --smollm2 .gpudata/data-open344.tar.xz; (11 calls) bash ... unpack
#   export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True OMP_NUM_THREADS=4
#   C="INIT=eaglet/drafters/smollm2-135m-instruct-eagle3 EPOCHS=0.6 WINDOW=4096 BATCH_TOKENS=20480 \
#      DATA=/tmp/all-topenself344 TRAIN_SECONDS=420 SEED=29 MEM_CAP=60"
#   env $C K=30 VOCAB=18432 OUT=$OUT/a bash ... alltrain & env $C K=31 OUT=$OUT/b bash ... alltrain & wait
#   DRAFTS="/tmp/train30/drafter /tmp/train31/drafter" bash ... pick; DRAFT=/tmp/train30/drafter NAME=win bash ... fetch
#   FIRST_SHARD=400 SELF_PROMPTS=$((460*2048)) BATCH=2048 OPENERS="tasks bench/gpu/openers-more.txt" \
#     DATA_SECONDS=290 MEM_CAP=88 bash ... self &  (stage 30's other settings: eaglet eval-draft ...); wait
#   DIRS=all-topenself400 NAME=open400 bash ... pack   # kept as .gpudata/data-open400.tar.xz
#   K=32 INIT=/tmp/train30/drafter EPOCHS=0.5 WINDOW=4096 BATCH_TOKENS=20480 DATA=/tmp/all-topenself400 \
#     TRAIN_SECONDS=135 SEED=31 bash ... alltrain; DRAFT=/tmp/train32/drafter NAME=32 bash ... fetch   # CPU eval
# Stages 33-36 (one H200; none kept): four
# fine-tunings of stage 32 side by side on 91,567 new turns (shards 440-492, kept as .gpudata/data-open440.tar.xz),
# the TTT steps' loss weights (DECAY) against the learning rate (LR), a 2 x 2:
#   ../shared/tools/stage-files --smollm2   # 11 calls, the last with .whl
#   export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True OMP_NUM_THREADS=4
#   O="tasks bench/gpu/openers-more.txt bench/gpu/openers-stem.txt"
#   FIRST_SHARD=440 SELF_PROMPTS=$((510*2048)) BATCH=2048 OPENERS="$O" DATA_SECONDS=430 MEM_CAP=88 bash ... self &
#   (stage 32's HumanEval tree 6,8,32: eaglet eval-draft ... --prompts humaneval --settings tree:6,8,32); wait
#   C="EPOCHS=0.3 WINDOW=4096 BATCH_TOKENS=16384 DATA=/tmp/all-topenself440 TRAIN_SECONDS=480 SEED=33 MEM_CAP=32"
#   for a in "33" "34 DECAY=0.6" "35 LR=3e-4" "36 DECAY=0.6 LR=3e-4"; do set -- $a; k=$1; shift
#     env $C K=$k "$@" OUT=$OUT/o$k bash ... alltrain > $OUT/train$k.log 2>&1 & done; wait
#   DIRS=all-topenself440 NAME=open440 bash ... pack
#   DRAFTS="/tmp/train33/drafter /tmp/train34/drafter /tmp/train35/drafter /tmp/train36/drafter" bash ... pick
# Stages 37-41 (one H200; in the bundled lineage): HumanEval-style
# code prompts (here: .venv/bin/python bench/code_prompts.py .gpudata/code_prompts.json.gz, 39,592 public functions'
# headers and docstrings from the standard library and site-packages), their greedy replies, three mixes from stage 32:
#   ../shared/tools/stage-files --smollm2 .gpudata/code_prompts.json.gz .gpudata/data-open440.tar.xz  # 14 calls
#   bash ... unpack & DATA_SECONDS=480 MEM_CAP=100 bash ... code   # 38,755 turns in 136 s; kept as data-code.tar.xz
#   C="WINDOW=4096 BATCH_TOKENS=16384 TRAIN_SECONDS=470 MEM_CAP=40 LR=1.5e-4"
#   env $C K=37 SEED=37 EPOCHS=0.33 DATA="/tmp/all-tcode /tmp/all-topenself440" OUT=$OUT/o37 bash ... alltrain &
#   env $C K=38 SEED=38 EPOCHS=1 DATA=/tmp/all-tcode OUT=$OUT/o38 bash ... alltrain &
#   env $C K=39 SEED=39 EPOCHS=0.28 DATA="/tmp/all-tcode /tmp/all-tcode /tmp/all-topenself440" OUT=$OUT/o39 bash ... alltrain &
#   wait; DRAFTS="/tmp/train37/drafter /tmp/train38/drafter /tmp/train39/drafter" bash ... pick
#   SETS=mtbench DRAFT=/tmp/train37/drafter bash ... eval & SETS=humaneval DRAFT=/tmp/train37/drafter bash ... eval &
#   DRAFT=/tmp/train37/drafter NAME=37 bash ... fetch; DIRS=all-tcode NAME=code bash ... pack; wait
# then, on a fresh machine with stage 37 bundled, ShareGPT's human-written turns against the self-written ones:
#   bash ... prepare (here); ../shared/tools/stage-files --smollm2 .gpudata/sharegpt_user_turns.json.gz \
#     .gpudata/data-code.tar.xz .gpudata/data-open440.tar.xz   # 15 calls; bash ... unpack &
#   TEMPS=0 BATCH=2048 DATA_SECONDS=110 MEM_CAP=100 bash ... all   # 17,529 ShareGPT turns, greedy (9 shards)
#   C="WINDOW=4096 BATCH_TOKENS=16384 TRAIN_SECONDS=165 MEM_CAP=60"
#   env $C K=40 SEED=40 EPOCHS=0.12 DATA="/tmp/all-t0 /tmp/all-tcode /tmp/all-topenself440" OUT=$OUT/o40 bash ... alltrain &
#   env $C K=41 SEED=41 EPOCHS=0.25 DATA="/tmp/all-t0 /tmp/all-tcode" OUT=$OUT/o41 bash ... alltrain &
#   wait; DRAFTS="/tmp/train40/drafter /tmp/train41/drafter" bash ... pick
# Stages 42-47 (one H200; none kept): stage 37
# drafting through the target's output layer (SHARED=1: the trainer turns it onto it, eagle3_outmap, as bench/cpu/turn_drafter.py does; then
# trained), at its own MLP width and at 7,680, against the same training without (44), on 37's data:
#   ../shared/tools/stage-files --smollm2 .gpudata/data-code.tar.xz .gpudata/data-open440.tar.xz  # 15 calls
#   bash ... unpack; C="WINDOW=4096 BATCH_TOKENS=8192 TRAIN_SECONDS=460 LR=1.5e-4 EPOCHS=0.25"
#   D="/tmp/all-tcode /tmp/all-topenself440"
#   env $C K=42 SEED=42 SHARED=1 MEM_CAP=46 DATA="$D" OUT=$OUT/a bash ... alltrain &
#   env $C K=43 SEED=43 SHARED=1 WIDTH=7680 MEM_CAP=46 DATA="$D" OUT=$OUT/b bash ... alltrain &
#   env $C K=44 SEED=44 MEM_CAP=40 DATA="$D" OUT=$OUT/c bash ... alltrain &
#   wait; DRAFTS="/tmp/train42/drafter /tmp/train43/drafter /tmp/train44/drafter" bash ... pick
#   C="WINDOW=4096 BATCH_TOKENS=8192 TRAIN_SECONDS=400 LR=1.5e-4 EPOCHS=0.35 SHARED=1 MEM_CAP=60"  # twice: the
#   env $C K=45 SEED=45 INIT=/tmp/train42/drafter DATA="$D" bash ... alltrain &    # second call finished
#   env $C K=46 SEED=46 INIT=/tmp/train43/drafter DATA="$D" bash ... alltrain &    # the last 55 and 202 steps
#   wait; DRAFTS="/tmp/train45/drafter /tmp/train46/drafter" bash ... pick
#   WINDOW=4096 BATCH_TOKENS=8192 TRAIN_SECONDS=230 EPOCHS=0.22 SHARED=1 MEM_CAP=80 K=47 SEED=47 \
#     INIT=/tmp/train46/drafter DATA="$D" bash ... alltrain; DRAFTS="/tmp/train46/drafter /tmp/train47/drafter" bash ... pick
# Stages 48-52 (one H200; none kept): stage 37 with a wider attention (HEADS/KV_HEADS,
# Eagle3Head.widen_attention) or attention and MLP both, and with sharper soft labels (TEMP), on 37's data as stage 44:
#   ../shared/tools/stage-files --smollm2 .gpudata/data-code.tar.xz .gpudata/data-open440.tar.xz  # 15 calls
#   bash ... unpack; C="WINDOW=4096 BATCH_TOKENS=8192 TRAIN_SECONDS=460 LR=1.5e-4 EPOCHS=0.25"
#   D="/tmp/all-tcode /tmp/all-topenself440"
#   env $C K=48 SEED=48 HEADS=18 KV_HEADS=9 MEM_CAP=40 DATA="$D" OUT=$OUT/a bash ... alltrain &
#   env $C K=49 SEED=49 HEADS=36 KV_HEADS=18 MEM_CAP=40 DATA="$D" OUT=$OUT/b bash ... alltrain &
#   env $C K=50 SEED=50 HEADS=18 KV_HEADS=9 WIDTH=6144 MEM_CAP=40 DATA="$D" OUT=$OUT/c bash ... alltrain &
#   wait; DRAFTS="/tmp/train48/drafter /tmp/train49/drafter /tmp/train50/drafter" bash ... pick
#   C="WINDOW=4096 BATCH_TOKENS=8192 TRAIN_SECONDS=330 LR=1.5e-4 EPOCHS=0.25"
#   env $C K=51 SEED=51 TEMP=0.5 MEM_CAP=60 DATA="$D" OUT=$OUT/a bash ... alltrain &
#   env $C K=52 SEED=52 TEMP=0.25 MEM_CAP=60 DATA="$D" OUT=$OUT/b bash ... alltrain &
#   wait; DRAFTS="/tmp/train51/drafter /tmp/train52/drafter" bash ... pick
# Stages 53-56 (one H200; none kept): a second decoder layer (LAYERS=2, vLLM's
# layout; Eagle3Head.deepen) against the same head kept at one layer, the same seed and new turns, two rounds:
#   ../shared/tools/stage-files --smollm2   # 12 calls, the last with .whl, then beside the data: bash ... deepcheck
#   O="tasks bench/gpu/openers-more.txt bench/gpu/openers-stem.txt"
#   FIRST_SHARD=493 SELF_PROMPTS=$((513*2048)) BATCH=2048 OPENERS="$O" DATA_SECONDS=300 MEM_CAP=100 bash ... self
#   C="WINDOW=4096 BATCH_TOKENS=8192 TRAIN_SECONDS=480 LR=1.5e-4 EPOCHS=0.8 SEED=53 MEM_CAP=60 DATA=/tmp/all-topenself493"
#   env $C K=53 OUT=/tmp/o53 bash ... alltrain & env $C K=54 LAYERS=2 OUT=/tmp/o54 bash ... alltrain & wait
#   (eaglet eval-draft --draft /tmp/trainK/drafter --prompts SET --max-new-tokens 256 --batch 200 --settings chain:5,
#    the four at once)
#   FIRST_SHARD=513 SELF_PROMPTS=$((533*2048)) BATCH=2048 OPENERS="$O" DATA_SECONDS=200 MEM_CAP=100 bash ... self
#   C="WINDOW=4096 BATCH_TOKENS=8192 TRAIN_SECONDS=270 LR=1.5e-4 EPOCHS=0.8 SEED=55 MEM_CAP=60 DATA=/tmp/all-topenself513"
#   env $C K=55 INIT=/tmp/train53/drafter ... alltrain & env $C K=56 INIT=/tmp/train54/drafter ... alltrain & wait
#   (the same evaluation of 55 and 56)
# Data phases write their JSON record (counts, wall time, environment) into $OUT/records; they stop
# starting shards DATA_SECONDS - 45 s in (`eaglet data --time-limit`), so a cut run still writes it.
# The self-written turns need the MT-bench and HumanEval wheels in .whl (their prompts are kept out).
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
# The four training stages of the bundled drafter: each a fresh warmup + cosine schedule
# starting from the previous stage's export (warm restarts), over the same data, ~2.5 min each at
# ~58k assistant tokens/s: epochs lr seed
STAGES=("1.5 5e-4 0" "1.5 3e-4 1" "1 2e-4 2" "1 1.5e-4 3")
case $phase in
  data)
    # The GPU machine cannot receive the 125 MB ShareGPT package: `prepare` keeps its conversations'
    # user turns (what `eaglet data` uses), ids kept, so the held-out split is the same; they travel
    # staged with the model: ../shared/tools/stage-files --smollm2 .gpudata/sharegpt_user_turns.json.gz
    turns=/tmp/stage/sharegpt_user_turns.json.gz; [ -f $turns ] || turns=.gpudata/sharegpt_user_turns.json.gz
    [ -f /tmp/sharegpt.json ] || gunzip -c $turns > /tmp/sharegpt.json
    # The bundled drafter's data: the first 19 shards (38,912 prompts) of 28, what its 7-minute call made.
    time timeout ${DATA_SECONDS:-580} python3 -m eaglet data --model $GGUF --dtype bfloat16 --out /tmp/data \
      --source /tmp/sharegpt.json --turns ${TURNS:-all} --limit ${LIMIT:-38912} \
      --batch ${BATCH:-1024} --max-new-tokens 320 --max-prompt-tokens 512 --shard-size 2048 --record-dir ${OUT:-/tmp}/records \
      --time-limit $((${DATA_SECONDS:-580} - 45))
    ls /tmp/data | wc -l ;;
  more|all)
    # more: the shards 19..27 the first four stages left out (stage 5); all: every shard (stage 6)
    first=${FIRST_SHARD:-0}; [ $phase = more ] && first=19
    turns=/tmp/stage/sharegpt_user_turns.json.gz; [ -f $turns ] || turns=.gpudata/sharegpt_user_turns.json.gz
    [ -f /tmp/sharegpt.json ] || gunzip -c $turns > /tmp/sharegpt.json
    for t in ${TEMPS:-0 0.8}; do
      # SEED=N (N > 0): another draw of the sampled replies, into /tmp/$phase-t${t}sN
      dir=/tmp/$phase-t$t${SEED:+s$SEED}
      time timeout ${DATA_SECONDS:-570} python3 -m eaglet data --model $GGUF --dtype bfloat16 --out $dir \
        --source /tmp/sharegpt.json --turns all --first-shard $first --temperature $t --seed ${SEED:-0} \
        --batch ${BATCH:-1024} --max-new-tokens 320 --max-prompt-tokens 512 --shard-size 2048 --record-dir ${OUT:-/tmp}/records \
        --time-limit $((${DATA_SECONDS:-570} - 45))
      ls $dir | wc -l  # its shards + heldout.jsonl + meta.json when complete
    done ;;
  self)
    # FIRST_SHARD=15 SELF_PROMPTS=61440 writes shards 15..29 (their own seeds, so other turns) into all-tself15
    # OPENERS=tasks: each turn starts with one of the built-in openings (`--prompt-openers`), into all-topen*;
    # OPENERS="tasks FILE": the built-in ones, then a file's
    first=${FIRST_SHARD:-0}; dir=/tmp/all-t${OPENERS:+open}self; [ "$first" -gt 0 ] && dir=$dir$first
    time timeout ${DATA_SECONDS:-570} python3 -m eaglet data --model $GGUF --dtype bfloat16 --out $dir \
      --self-prompts ${SELF_PROMPTS:-30720} --first-shard $first --temperature 0 --batch ${BATCH:-1024} \
      --max-new-tokens 320 --max-prompt-tokens 256 --shard-size 2048 --record-dir ${OUT:-/tmp}/records \
      --time-limit $((${DATA_SECONDS:-570} - 45)) ${OPENERS:+--prompt-openers $OPENERS} \
      ${MEM_CAP:+--max-gpu-memory $MEM_CAP}
    rc=$?; ls $dir | wc -l; exit $rc ;;  # the data job's status, not ls's (`round` reads it)
  code)
    # HumanEval-style prompts (bench/code_prompts.py: public functions' headers and docstrings from the Python
    # sources, staged as code_prompts.json.gz): the target's greedy replies, into /tmp/all-tcode
    src=/tmp/stage/code_prompts.json.gz; [ -f $src ] || src=.gpudata/code_prompts.json.gz
    [ -f /tmp/code_prompts.json ] || gunzip -c $src > /tmp/code_prompts.json
    time timeout ${DATA_SECONDS:-570} python3 -m eaglet data --model $GGUF --dtype bfloat16 --out /tmp/all-tcode \
      --source /tmp/code_prompts.json --turns first --temperature 0 --batch ${BATCH:-2048} --max-new-tokens 320 \
      --max-prompt-tokens 512 --shard-size 2048 --record-dir ${OUT:-/tmp}/records \
      --time-limit $((${DATA_SECONDS:-570} - 45)) ${MEM_CAP:+--max-gpu-memory $MEM_CAP}
    rc=$?; ls /tmp/all-tcode | wc -l; exit $rc ;;
  self2)
    # self-written turns on two GPUs at once: shards START..START+14 on GPU 0, START+15..START+29 on
    # GPU 1 (their own seeds, so other turns than stage 7's shards 0-29), into all-tselfSTART and
    # all-tself(START+15); logs in $OUT
    a=${START:-30}; b=$((a + 15))
    CUDA_VISIBLE_DEVICES=0 FIRST_SHARD=$a SELF_PROMPTS=$((b * 2048)) bash "$0" self > ${OUT:-/tmp}/self-gpu0.log 2>&1 &
    CUDA_VISIBLE_DEVICES=1 FIRST_SHARD=$b SELF_PROMPTS=$(((b + 15) * 2048)) bash "$0" self > ${OUT:-/tmp}/self-gpu1.log 2>&1 &
    wait; ls -d /tmp/all-t* ;;
  finetune|alltrain)
    # stage 5 (finetune: on `more`'s data, lr 2e-4) or stage 6/7 (alltrain: on `all`'s, lr 1.5e-4,
    # K=6 or 7), from the bundled drafter; a call stopped at TRAIN_SECONDS resumes in the next.
    # NPROC=2: data parallel over two GPUs (torchrun, NCCL), --batch-tokens per GPU.
    # WIDTH=N: widen the drafter's MLP to N first (its function kept; the added width starts at zero).
    # HEADS=N KV_HEADS=M: widen its attention to N query / M key-value heads first (the same function: each
    # key-value head copied, the added query heads write nothing yet; Eagle3Head.widen_attention).
    # TEMP=T: train toward the target's distribution sharpened to temperature T (0: its argmax).
    # VOCAB=N: re-choose the draft vocabulary as the data's N most frequent ids (the drafter's rows of
    # ids it keeps stay, the others are fitted from the target's output rows). SEED=N: another seed than K-1.
    # WINDOW=ROWS, BATCH_TOKENS=N: --length-window (default 256) and --batch-tokens (default 32768).
    # MEM_CAP=GIB: --max-gpu-memory (so a data phase fits beside it; `self` takes it too).
    # LR=X: another peak learning rate than 1.5e-4; DECAY=G: the TTT steps' loss weights G^k (default 0.8).
    # LAYERS=N: deepen the drafter to N decoder layers first (vLLM's layers.1, ...: the added layers write nothing yet).
    # SHARED=1: draft through the target's output layer (--shared-lm-head; with WIDTH=N the freed 21 MB can widen the MLP;
    # its logits span all 49,152 ids: at BATCH_TOKENS=8192 a trainer peaked at 26.4 GiB, 29.2 with WIDTH=7680, stages 42-47).
    read -r data k lr <<< "$([ $phase = finetune ] && echo "more 5 2e-4" || echo "all ${K:-7} 1.5e-4")"
    mkdir -p ${OUT:-/tmp}/records
    launch="python3"; [ "${NPROC:-1}" -gt 1 ] && launch="python3 -m torch.distributed.run --nproc-per-node $NPROC"
    $launch -m eaglet train-draft --model $GGUF --dtype bfloat16 --data ${DATA:-/tmp/$data-t*} \
      --out /tmp/train$k --init-from ${INIT:-eaglet/drafters/smollm2-135m-instruct-eagle3} --epochs ${EPOCHS:-1} \
      --lr ${LR:-$lr} --seed ${SEED:-$((k - 1))} --batch-tokens ${BATCH_TOKENS:-32768} --max-len 1024 ${VOCAB:+--draft-vocab $VOCAB} --save-every 200 \
      --time-limit ${TRAIN_SECONDS:-540} ${WIDTH:+--intermediate-size $WIDTH} ${WINDOW:+--length-window $WINDOW} \
      ${TEMP:+--target-temperature $TEMP} ${DECAY:+--step-decay $DECAY} ${MEM_CAP:+--max-gpu-memory $MEM_CAP} \
      ${SHARED:+--shared-lm-head} ${HEADS:+--num-attention-heads $HEADS} ${KV_HEADS:+--num-key-value-heads $KV_HEADS} \
      ${LAYERS:+--num-layers $LAYERS} || exit 1
    cp /tmp/train$k/train-draft-*.json ${OUT:-/tmp}/records/
    ln -sfn /tmp/train$k /tmp/train ;;
  train)
    # STAGE=1..4 (default: every stage not yet finished, in order); each stage checkpoints, so
    # a call stopped at its limit resumes. The export of the last stage is /tmp/train/drafter.
    mkdir -p ${OUT:-/tmp}/records
    for k in ${STAGE:-1 2 3 4}; do
      read -r epochs lr seed <<< "${STAGES[$((k - 1))]}"
      init=; [ "$k" -gt 1 ] && init="--init-from /tmp/train$((k - 1))/drafter"
      [ -f /tmp/train$k/done ] && [ -z "$STAGE" ] && continue
      python3 -m eaglet train-draft --model $GGUF --dtype bfloat16 --data /tmp/data --out /tmp/train$k $init \
        --epochs $epochs --lr $lr --seed $seed --batch-tokens 32768 --max-len 1024 --draft-vocab 16384 \
        --save-every 200 || exit 1
      touch /tmp/train$k/done
      cp /tmp/train$k/train-draft-*.json ${OUT:-/tmp}/records/
    done
    ln -sfn /tmp/train4 /tmp/train ;;
  profile)  # where a training step's time goes, phase by phase, kernel by kernel (after a data phase)
    mkdir -p ${OUT:-/tmp}/records
    python3 bench/gpu/train_profile.py $GGUF /tmp/all-t* --out ${OUT:-/tmp}/records \
      --init-from eaglet/drafters/smollm2-135m-instruct-eagle3 --batch-tokens 32768 --max-len 1024 ;;
  round)
    # One GPU, two jobs: `alltrain` (K, INIT, EPOCHS, DATA, ... as above) while `self` writes the next
    # round's shards beside it (FIRST_SHARD, SELF_PROMPTS, BATCH, OPENERS, DATA_SECONDS), each under a
    # memory cap (TRAIN_CAP, default 48 GiB: the trainer peaked at 28.5 with expandable segments;
    # DATA_CAP, default 88: regeneration at BATCH=2048 peaked at 41.4 allocated / 43.0 reserved, and
    # 40 runs out at its first batch); logs in $OUT.
    : "${K:?round needs K=stage}" "${FIRST_SHARD:?round needs FIRST_SHARD=}"; mkdir -p ${OUT:-/tmp}
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True MEM_CAP=${TRAIN_CAP:-48} bash "$0" alltrain \
      > ${OUT:-/tmp}/train$K.log 2>&1 &
    trainer=$!
    sleep 20  # the trainer loads first
    MEM_CAP=${DATA_CAP:-88} bash "$0" self > ${OUT:-/tmp}/data-from$FIRST_SHARD.log 2>&1; data_rc=$?
    wait $trainer; rc=$?; tail -c 400 ${OUT:-/tmp}/train$K.log; tail -c 300 ${OUT:-/tmp}/data-from$FIRST_SHARD.log
    echo "round: training exit $rc, data exit $data_rc"; [ $rc -eq 0 ] && [ $data_rc -eq 0 ] ;;
  eval)  # DRAFT=DIR: another export than the last trained one (/tmp/train/drafter)
    for set in ${SETS:-mtbench humaneval}; do
      python3 -m eaglet eval-draft --model $GGUF --dtype float32 --draft ${DRAFT:-/tmp/train/drafter} --prompts $set \
        --max-new-tokens 256 --batch 200 --settings chain:5 chain:7 tree:5,4,16 tree:6,8,32 --out ${OUT:-/tmp}/records
    done ;;
  pick)  # DRAFTS="DIR DIR ...": chain-5 τ of each export on both sets, evaluated side by side; the one
    # with the higher mean of the two goes to /tmp/winner (records in $OUT/records/pickN)
    # (leave OUT the call's own: OUT=$OUT/pk puts them a folder deeper than a call returns)
    i=0; for d in ${DRAFTS:?name the exports}; do i=$((i + 1))
      (for set in mtbench humaneval; do python3 -m eaglet eval-draft --model $GGUF --dtype float32 --draft $d \
         --prompts $set --max-new-tokens 256 --batch 200 --settings chain:5 --out ${OUT:-/tmp}/records/pick$i; done) &
    done; wait
    python3 - ${OUT:-/tmp}/records $DRAFTS <<'PY'
import glob, json, sys
out, drafts = sys.argv[1], sys.argv[2:]
taus = []
for i, d in enumerate(drafts, 1):
    recs = [json.load(open(f)) for f in sorted(glob.glob(f"{out}/pick{i}/eval-draft-*.json"))]
    t = {r["flags"]["prompts"]: r["results"]["chain:5"]["accept_length"] for r in recs}
    taus.append(sum(t.values()) / 2 if len(t) == 2 else 0.0)
    print(f"pick: {d}: chain 5 τ {t}")
best = drafts[max(range(len(drafts)), key=taus.__getitem__)]
open("/tmp/winner", "w").write(best)
print(f"pick: {best}")
PY
    ;;
  deepcheck)  # the bundled drafter deepened to LAYERS (default 2) layers drafts exactly as it does, through the
    # graphed speculation loop: chain-5 counts of both on the first N (default 8) MT-bench prompts, side by side
    GGUF=$GGUF python3 - <<'PY'
import os, torch
from eaglet.spec.drafters.eagle3_ckpt import load_eagle3, save_eagle3
from eaglet.weights import load_model
target = load_model(os.environ["GGUF"], "float32", "cpu", tokenizer=False).model
head, _ = load_eagle3("eaglet/drafters/smollm2-135m-instruct-eagle3", target.config, "cpu", torch.float32)
save_eagle3(head.deepen(int(os.environ.get("LAYERS", 2)), torch.Generator().manual_seed(0)), "/tmp/deep", torch.bfloat16)
PY
    i=0; for d in eaglet/drafters/smollm2-135m-instruct-eagle3 /tmp/deep; do i=$((i + 1))
      python3 -m eaglet eval-draft --model $GGUF --dtype float32 --draft $d --prompts mtbench --num-prompts ${N:-8} \
        --max-new-tokens 128 --batch 8 --settings chain:5 --out /tmp/deepcheck/$i > /tmp/deepcheck-$i.log 2>&1 &
    done; wait
    python3 -c "import glob, json; [print('deepcheck:', f, json.load(open(f))['results']['chain:5']['accepted_per_pos'])
                for f in sorted(glob.glob('/tmp/deepcheck/*/eval-draft-*.json'))]" ;;
  pack)  # data shards back through $OUT: one xz tar, split into 15 MB parts
    mkdir -p ${OUT:-/tmp}/data
    tar cf - -C /tmp ${DIRS:?name the /tmp data dirs} | xz -T8 -6 | split -b 15M - ${OUT:-/tmp}/data/data-${NAME:?}.tar.xz.part-
    ls -l ${OUT:-/tmp}/data ;;
  unpack)  # staged data-*.tar.xz back into /tmp
    for f in /tmp/stage/data-*.tar.xz; do xz -dc $f | tar xf - -C /tmp; done; ls -d /tmp/all-t* ;;
  fetch)  # the export (DRAFT=DIR, default the last trained one) back through $OUT (files of at most 16 MiB)
    # as $OUT/drafter (NAME=X: $OUT/drafter-X): split, joined again here with cat
    dst=${OUT:-/tmp}/drafter${NAME:+-$NAME}; src=${DRAFT:-/tmp/train/drafter}
    mkdir -p $dst && cp $src/config.json $dst/ && split -b 15M $src/model.safetensors $dst/model.safetensors.part- ;;
esac
