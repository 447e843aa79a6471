#!/usr/bin/env bash
# Mixed sampling settings against the same load sent all greedy, on one `eaglet serve` (SmolLM2,
# the bundled drafter, the default policy: speculating alone, plain when several run): `eaglet
# bench-serve --mix` (temperatures 0/0.3/0.7/1.0, top-p and top-k on some, seeds on a quarter,
# max_tokens log-uniform 16-512, half streamed) and `--mix greedy` (the same lengths and streaming,
# temperature 0), alternating, ROUNDS times (default 2) at each concurrency in CONC (default 1 16 64),
# after a warm-up run of each; 8 requests a stream, at least MIN_REQUESTS (default 32). Needs what
# serve.sh needs staged (the model, sharegpt_first_turns.json.gz, the server and client wheels in .whl).
# With $OUT set the records come back as $OUT/serve-mix-records.tar.
source "$(dirname "$0")/setup.sh"
set +e
out=/tmp/serve-mix-records  # records here, packed into $OUT/serve-mix-records.tar after every round: a call cut
rm -rf "$out"; mkdir -p "$out"  # short by its limit still brings back what it measured (a call returns 8 files)
keep() { [ -z "${OUT:-}" ] || tar -C "$out" -cf "$OUT/serve-mix-records.tar" .; }
gunzip -c /tmp/stage/sharegpt_first_turns.json.gz > /tmp/sharegpt.json
python3 -m eaglet serve --model $GGUF --port 8041 --max-batch 64 --max-model-len 1024 \
  --draft $PWD/eaglet/drafters/smollm2-135m-instruct-eagle3 --log-level warning &
pid=$!
wait_health 8041 ${WAIT:-600}
bs() { python3 -m eaglet bench-serve --url http://127.0.0.1:8041 --prompts /tmp/sharegpt.json --max-tokens 512 \
         --max-prompt-chars 600 --seed 0 --no-progress "$@"; }
for c in ${CONC:-1 16 64}; do
  lo=${MIN_REQUESTS:-32}; n=$(( c * 8 > lo ? c * 8 : lo ))
  for mix in sampled greedy; do bs --num-requests $n --concurrency $c --mix $mix > /dev/null; done
  for round in $(seq ${ROUNDS:-2}); do
    for mix in sampled greedy; do
      echo "== --mix $mix, concurrency $c, round $round"
      bs --num-requests $n --concurrency $c --mix $mix --out "$out" | grep -E "requests|throughput|TTFT|TPOT|mix|memory|record"
    done
    keep
  done
done
kill $pid; wait 2>/dev/null
save_caches
keep; echo "records: $out"
