#!/usr/bin/env bash
# Speculation settings against each other through `eaglet serve` on the H200, at one concurrency: one
# server per setting in SETTINGS (each with --max-batch MAX_BATCH, default 1: only the rows a
# closed loop of CONC clients fills) and one with --spec none, all started at once; then, after a
# warm-up run of each, ROUNDS rounds of `eaglet bench-serve` (ShareGPT first turns, 128 tokens, EOS
# ignored), each round every server in turn, so all see the same state of the machine. Compare the
# medians over rounds: which setting a concurrency should get, measured end to end rather than from
# a profile's cost model.
#   SETTINGS="tree:3,4,16 tree:4,4,16 chain:3" CONC=1 ROUNDS=3 bash bench/gpu/serve_sweep.sh
# Needs what serve.sh needs (the model and sharegpt_first_turns.json.gz staged, the wheels in .whl).
# With $OUT set the records come back as $OUT/sweep-records.tar; each record's url names its port,
# and ports.txt (in the tar) which setting each port served.
source "$(dirname "$0")/setup.sh"
set +e
out=${OUT:-/tmp}/sweep
mkdir -p "$out"
[ -f /tmp/sharegpt.json ] || gunzip -c /tmp/stage/sharegpt_first_turns.json.gz > /tmp/sharegpt.json
settings=(${SETTINGS:-tree:3,4,16 tree:4,4,16} none)
pids=() port=8040
for s in "${settings[@]}"; do
  port=$((port + 1))
  if [ $s = none ]; then args="--spec none"; else
    IFS=:, read -r kind steps topk tokens <<< "$s"
    args="--draft eaglet/drafters/smollm2-135m-instruct-eagle3 --spec-steps $steps"
    if [ $kind = tree ]; then args="$args --spec-topk $topk --spec-draft-tokens $tokens"; else args="$args --spec-topk 1"; fi
  fi
  echo "$port $s" >> "$out/ports.txt"
  python3 -m eaglet serve --model $GGUF --port $port --max-batch ${MAX_BATCH:-1} --max-model-len 1024 $args \
    --log-level warning &
  pids+=($!)
done
for p in $(cut -d' ' -f1 "$out/ports.txt"); do wait_health $p; done
c=${CONC:-1}; n=$(( c * 8 > 32 ? c * 8 : 32 ))
bs() { python3 -m eaglet bench-serve --url http://127.0.0.1:$1 --prompts /tmp/sharegpt.json --max-tokens 128 \
         --ignore-eos --max-prompt-chars 600 --seed 0 --no-progress --num-requests $n --concurrency $c "${@:2}" < /dev/null; }
while read -r p s; do bs $p > /dev/null; done < "$out/ports.txt"
for round in $(seq ${ROUNDS:-3}); do
  while read -r p s; do
    echo "== $s (port $p), concurrency $c, round $round"
    bs $p --out "$out" | grep -E "throughput|accept"
  done < "$out/ports.txt"
done
kill "${pids[@]}"; wait 2>/dev/null
[ -n "${OUT:-}" ] && tar -C "$out" -cf "$OUT/sweep-records.tar" . && rm -rf "$out"
