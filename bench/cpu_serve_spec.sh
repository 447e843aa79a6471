#!/usr/bin/env bash
# `eaglet serve` on the CPU with speculation (the default: the bundled EAGLE-3 drafter, a chain of
# one draft on the CPU) against `--spec none`, at each concurrency in CONC, with `eaglet bench-serve`
# (ShareGPT first turns); one record per run in bench/results/.
#   bash bench/cpu_serve_spec.sh        (about 5 min on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${PORT:-8012}
for spec in eagle3 none; do
  .venv/bin/eaglet serve --port $PORT --max-batch 8 --max-model-len 1024 --spec $spec --log-level warning &
  server=$!
  until curl -sf http://127.0.0.1:$PORT/health > /dev/null; do sleep 1; done
  for c in ${CONC:-1 4}; do
    echo "spec $spec, concurrency $c"
    .venv/bin/eaglet bench-serve --url http://127.0.0.1:$PORT --num-requests $((c * ${PER_SLOT:-8})) --concurrency $c \
      --max-tokens ${MAX_TOKENS:-64} --ignore-eos --max-prompt-chars 300 --seed 0 --no-progress --out bench/results
  done
  kill $server
  wait $server 2>/dev/null || true
done
