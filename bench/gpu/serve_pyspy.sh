#!/usr/bin/env bash
# Where `eaglet serve`'s host time goes under load on the H200: one server (SERVE_ARGS), one warm-up
# run of `eaglet bench-serve` at each concurrency in CONC (default 64), then py-spy samples the server
# (all threads, idle ones too, 500 Hz, raw collapsed stacks) through a second run at that level, without
# pausing it (py-spy's default pauses the process a sample: the server ran at a quarter of its speed).
# Needs the model and sharegpt_first_turns.json.gz staged and the py-spy wheel in .whl.
#   SERVE_ARGS="--spec none" bash bench/gpu/serve_pyspy.sh
#   SERVE_ARGS="--draft eaglet/drafters/smollm2-135m-instruct-eagle3 --spec-policy PROFILE" bash bench/gpu/serve_pyspy.sh
# Fold a raw file: python3 bench/cpu/pyspy_fold.py FILE [DEPTH]
source "$(dirname "$0")/setup.sh"
set +e
out=${OUT:-/tmp}/pyspy
mkdir -p "$out"
[ -f /tmp/sharegpt.json ] || gunzip -c /tmp/stage/sharegpt_first_turns.json.gz > /tmp/sharegpt.json
python3 -m eaglet serve --model $GGUF --port 8033 --max-batch ${MAX_BATCH:-64} --max-model-len 1024 ${SERVE_ARGS:-} \
  --log-level warning &
pid=$!
wait_health 8033 ${WAIT:-600} || { echo 'serve_pyspy.sh: the server did not come up'; kill $pid; exit 1; }
bs() { python3 -m eaglet bench-serve --url http://127.0.0.1:8033 --prompts /tmp/sharegpt.json --max-tokens 128 \
         --ignore-eos --max-prompt-chars 600 --seed 0 --no-progress "$@"; }
for c in ${CONC:-64}; do
  n=$(( c * 8 > 32 ? c * 8 : 32 ))
  bs --num-requests $n --concurrency $c > /dev/null
  tag=${TAG:-serve}-c$c
  /tmp/site/bin/py-spy record -p $pid --nonblocking --idle --threads -r 500 -d ${SECONDS_REC:-6} -f raw -o "$out/$tag.txt" > /dev/null 2>&1 &
  spy=$!
  bs --num-requests $n --concurrency $c --out "$out" | grep -E "throughput|TPOT|ITL|accept"
  wait $spy
done
kill $pid; wait 2>/dev/null
