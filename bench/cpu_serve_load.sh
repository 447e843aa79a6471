#!/usr/bin/env bash
# The CPU load test of `eaglet serve` with SmolLM2-135M-Instruct and its bundled EAGLE-3 drafter:
# two identical rounds of `eaglet bench-serve` (200 ShareGPT first turns, concurrency 32), each
# written as a record to bench/results/. After each round the server's KV cache must be empty
# (free tokens == total, nothing running or waiting); its resident memory is printed after both.
# MIX=1: each request its own sampling settings and length (`bench-serve --mix`, max_tokens up to
# MAX_TOKENS), the soak of mixed traffic, and after each round CHECK_SEEDED (default 40) of its seeded
# requests sent again alone must get the text they got under load (`--check-seeded`); REQUESTS,
# MAX_TOKENS and OUT (the records' directory) override; SERVE_ARGS adds server flags (e.g.
# --engine-process: /metrics then reports the engine's process, and the HTTP process's RSS is printed too).
#   bash bench/cpu_serve_load.sh          (about 10 min on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${PORT:-8011}
ROUND=(--url http://127.0.0.1:$PORT --num-requests ${REQUESTS:-200} --concurrency 32 --max-tokens ${MAX_TOKENS:-24}
       --max-prompt-chars 300 --seed 0 --no-progress --out ${OUT:-bench/results} ${MIX:+--mix --check-seeded ${CHECK_SEEDED:-40}})
.venv/bin/eaglet serve --port $PORT --max-batch 16 --max-model-len 1024 --log-level warning ${SERVE_ARGS:-} &
server=$!
trap 'kill $server' EXIT
until curl -sf http://127.0.0.1:$PORT/health > /dev/null; do sleep 1; done
check() {
  sleep 1
  curl -s http://127.0.0.1:$PORT/metrics | .venv/bin/python -c '
import sys
from eaglet.perf.bench_serve import server_metrics
m = server_metrics(sys.stdin.read())
free, total = m["eaglet:kv_cache_free_tokens"], m["eaglet:kv_cache_total_tokens"]
running, waiting = m["eaglet:num_requests_running"], m["eaglet:num_requests_waiting"]
rss = m["process_resident_memory_bytes"] / 2**20
print(f"KV free {free:.0f} / {total:.0f}, running {running:.0f}, waiting {waiting:.0f}, server RSS {rss:.0f} MiB")
sys.exit(0 if free == total and running == waiting == 0 else 1)'
  echo "RSS (ps, MiB): server $(( $(ps -o rss= -p $server) / 1024 ))$(for c in $(pgrep -P $server); do echo -n ", its child $(( $(ps -o rss= -p $c) / 1024 ))"; done)"
}
for round in 1 2; do
  echo "round $round"
  .venv/bin/eaglet bench-serve "${ROUND[@]}"
  check
done
