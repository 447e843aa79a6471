#!/usr/bin/env bash
# Issue 7's bar on the H200: `eaglet serve` on SmolLM2 with its speculation policy (the default
# drafter; speculating in batches that start with at most --spec-max-batch requests) against
# `--spec none`, each at concurrency 1, 4, 16 and 64 with `eaglet bench-serve` (ShareGPT first
# turns, 128 tokens, EOS ignored). Each level runs twice; the first (graph capture) is not recorded.
#   bash bench/gpu/serve.sh            (needs the model and sharegpt_first_turns.json.gz staged,
#                                       and the fastapi/uvicorn/pydantic/httpx wheels in .whl)
source "$(dirname "$0")/setup.sh"
set +e
out=${OUT:-/tmp}/records
mkdir -p "$out"
gunzip -c /tmp/stage/sharegpt_first_turns.json.gz > /tmp/sharegpt.json
PORT=8031
for spec in ${SPECS:-eagle3 none}; do
  draft=; [ $spec = eagle3 ] && draft="--draft eaglet/drafters/smollm2-135m-instruct-eagle3"
  python3 -m eaglet serve --model $GGUF --port $PORT --max-batch ${MAX_BATCH:-64} --max-model-len 1024 --spec $spec \
    $draft --log-level warning &
  server=$!
  for i in $(seq 180); do  # model load and compile: up to 3 minutes
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health')" 2>/dev/null && break
    kill -0 $server 2>/dev/null || { echo "serve exited"; break; }
    sleep 1
  done
  bs() { python3 -m eaglet bench-serve --url http://127.0.0.1:$PORT --prompts /tmp/sharegpt.json --max-tokens 128 \
           --ignore-eos --max-prompt-chars 600 --seed 0 --no-progress "$@"; }
  for c in ${CONC:-1 4 16 64}; do
    echo "== spec $spec, concurrency $c"
    n=$(( c * 4 > 8 ? c * 4 : 8 ))
    bs --num-requests $n --concurrency $c > /dev/null
    bs --num-requests $n --concurrency $c --out "$out" | tail -12
  done
  kill $server; wait $server 2>/dev/null
done
