#!/usr/bin/env bash
# Issue 55 on a machine of several H200s (nvidia-h200-x2 / -x4 / -x8): each phase fits one device call.
#   bash bench/gpu/multi.sh proof   # eaglet env --tp N with settings that must reach every worker, and the
#                                   # trap of the case we start from (a setting put in place after the
#                                   # communicator exists), which eaglet must name
#   bash bench/gpu/multi.sh comm    # eaglet bench-comm: all-reduce 1 KiB-64 MiB and Kimi-K2's decode/verify
#                                   # messages, eager and graphed, over NVLink and with NCCL_P2P_DISABLE=1
#   bash bench/gpu/multi.sh shapes  # eaglet bench --shape --tp N: plain decode and the verify curve T = 1..64
#                                   # (SHAPES, default the dense and MoE shapes of issue 55; P2P=0 adds runs
#                                   #  with NCCL_P2P_DISABLE=1)
#   bash bench/gpu/multi.sh train   # drafter training data-parallel (torchrun) against --grad-accum N on one
# N runs over 2, 4, 8 up to the machine's GPU count (RANKS="2 4" to choose). NVLink multicast stays off in
# every process. Everything lands in $OUT/multi-<phase>.tar (records, plots, logs).
# A dry run of the commands on CPUs (gloo), e.g. before a multi-GPU session:
#   PATH=.venv/bin:$PATH DEVICE=cpu SHAPES=smollm2-135m RANKS=3 \
#     BENCH_ARGS="--context 16 --max-new-tokens 4 --repeats 1" bash bench/gpu/multi.sh shapes
phase=$1
source "$(dirname "$0")/setup.sh"
set +e
export NCCL_NVLS_ENABLE=0
dev=${DEVICE:+--device $DEVICE}
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
ranks=${RANKS:-$(for n in 2 4 8; do [ "$n" -le "$gpus" ] && echo $n; done)}
bench_args=${BENCH_ARGS:---context 512 --max-new-tokens 64 --repeats 3}
model=$([ -f "$GGUF" ] && echo "--model $GGUF")  # the staged SmolLM2, else the installed default
out=/tmp/records-multi-$phase-$$
mkdir -p "$out"
case $phase in
  proof)
    for n in $ranks; do
      python3 -m eaglet env --tp $n $dev --nccl-env NCCL_PROTO=LL NCCL_ALGO=Ring NCCL_P2P_LEVEL=SYS \
        --nccl-log-dir "$out/nccl-$n" --json > "$out/env-tp$n.json" 2> "$out/env-tp$n.err"
      python3 -m eaglet env --tp $n $dev --nccl-env NCCL_PROTO=LL NCCL_ALGO=Ring NCCL_P2P_LEVEL=SYS 2>&1 | tee -a "$out/env.log"
      python3 bench/gpu/nccl_trap.py $n ${DEVICE:-cuda} 2>&1 | tee -a "$out/trap.log"
    done ;;
  comm)
    for n in $ranks; do
      python3 -m eaglet bench-comm --tp $n $dev ${COMM_ARGS:-} --shape kimi-k2 --out "$out" 2>&1 | tee -a "$out/bench-comm.log"
      python3 -m eaglet bench-comm --tp $n $dev ${COMM_ARGS:-} --shape kimi-k2 --nccl-env NCCL_P2P_DISABLE=1 --out "$out" 2>&1 |
        tee -a "$out/bench-comm.log"
    done ;;
  shapes)
    for s in ${SHAPES:-llama-3.1-8b llama-3.1-70b qwen3-30b-a3b qwen3-235b-a22b kimi-k2}; do
      for n in 1 $ranks; do
        python3 -m eaglet bench --shape $s --tp $n $dev $bench_args --out "$out" 2>&1 |
          tee -a "$out/bench-shape.log"
        if [ -n "${P2P:-}" ] && [ "$n" -gt 1 ]; then
          python3 -m eaglet bench --shape $s --tp $n $dev --nccl-env NCCL_P2P_DISABLE=1 $bench_args \
            --out "$out" 2>&1 | tee -a "$out/bench-shape.log"
        fi
      done
    done ;;
  train)
    data=/tmp/train-data  # SmolLM2 answering 2,048 ShareGPT turns; batches small enough for 50 steps at N = 8
    python3 -m eaglet data $model $dev --out "$data" --limit ${DATA_LIMIT:-2048} 2>&1 | tail -2
    for n in $ranks; do
      torchrun --standalone --nproc-per-node $n -m eaglet train-draft $model $dev --data "$data" \
        --out "$out/dp$n" --max-steps ${STEPS:-50} ${TRAIN_ARGS:---batch-tokens 2048} 2>&1 | tee -a "$out/train.log"
      python3 -m eaglet train-draft $model $dev --data "$data" --out "$out/ga$n" --grad-accum $n \
        --max-steps ${STEPS:-50} ${TRAIN_ARGS:---batch-tokens 2048} 2>&1 | tee -a "$out/train.log"
    done ;;
  *) echo "multi.sh: phase proof, comm, shapes or train" >&2; exit 2 ;;
esac
tar -cf "${OUT:-/tmp}/multi-$phase.tar" -C "$out" .
