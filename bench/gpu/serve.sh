#!/usr/bin/env bash
# Issue 7's bar on the H200: `eaglet serve` on SmolLM2 with its speculation policy (the default
# drafter; speculating in batches of at most --spec-max-batch requests) against `--spec none`, at
# concurrency 1, 4, 16 and 64 with `eaglet bench-serve` (ShareGPT first turns, 128 tokens, EOS
# ignored). Both servers run at once (an idle one waits on a condition variable) and each level
# alternates between them: a warm-up run of each (not recorded), then policy, none, ROUNDS times
# (default 3), so both see the same state of the shared machine; compare medians over rounds.
#   bash bench/gpu/serve.sh prepare    (here: .gpudata/sharegpt_first_turns.json.gz, to stage with the model)
#   bash bench/gpu/serve.sh            (needs the model and sharegpt_first_turns.json.gz staged,
#                                       and the fastapi/uvicorn/pydantic/aiohttp wheels in .whl:
#   .venv/bin/pip download --only-binary=:all: --python-version 3.12 --implementation cp -d .whl \
#     --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
#     fastapi uvicorn uvloop httptools pydantic httpx aiohttp py-spy)
# SPEC_POLICY=RECORD: an `eaglet profile` record whose per-batch-size policy the speculating server
# follows (default: bench/results/profile-gpu-20261130-225722.json, the H200 profile on
# the served ShareGPT prompts, batch sizes 1-64: tree 4,4,16 for one request, the fastest of six trees
# served side by side at concurrency 1 (serve_sweep.sh; 5,4,16 within 0.3%));
# SPEC_POLICY= for none; PROFILE=1: a profile of this machine on the served prompts,
# taken first, ~2.5 min, which with the ~6.5 min of serving nears one call's 10;
# SPEC_MAX_BATCH=N caps speculation at N requests;
# SPEC_ARGS: the speculating server's setting (EAGLE-3 on the GPU defaults to tree 5,4,16,
# i.e. "--spec-steps 5 --spec-topk 4 --spec-draft-tokens 16"; "--spec-steps 5": chain 5).
# ALT=DIR: a third server, speculating like the first but run from another eaglet package in DIR (e.g. a
# branch's eaglet/*.py, git-ignored and carried), beside it in every round: an A/B of two versions;
# ALT_NONE=1 with ALT: a fourth, `--spec none` from DIR (flags: ALT_NONE_ARGS) (the side by side with a previous commit,
# plain and speculating: `git archive SHA eaglet | tar -x -C .prev`, carry .prev, ALT=.prev ALT_NONE=1).
# SWITCH=1: one more server, this checkout speculating with --spec-switch (moving among the policy's settings).
# SERVE_ARGS: more flags for this checkout's servers (e.g. --multi-step 1); ALT_ARGS: for the ALT speculating
# server (ALT=$PWD ALT_ARGS="--spec-multi-step 2": an A/B of one flag on this checkout).
# With $OUT set (the GPU machine) the records come back as one tar, $OUT/serve-records.tar.
if [ "${1:-}" = prepare ]; then  # HERE, not on the GPU: ShareGPT first turns (<= 600 chars) into .gpudata/
  mkdir -p .gpudata && .venv/bin/python - <<'PY'
import gzip, json
from eaglet.datasets import first_turn, read_sharegpt
turns = [t for t in map(first_turn, read_sharegpt().conversations) if t and t.strip() and len(t) <= 600]
with gzip.open(".gpudata/sharegpt_first_turns.json.gz", "wt") as f:
    json.dump([{"conversations": [{"from": "human", "value": t}]} for t in turns], f)
print(len(turns), "first turns")
PY
  exit 0
fi
source "$(dirname "$0")/setup.sh"
set +e
out=/tmp/serve-records  # records here, packed into $OUT/serve-records.tar after every round: a call cut
rm -rf "$out"; mkdir -p "$out"  # short by its limit still brings back what it measured (a call returns 8 files)
keep() { [ -z "${OUT:-}" ] || tar -C "$out" -cf "$OUT/serve-records.tar" .; }
gunzip -c /tmp/stage/sharegpt_first_turns.json.gz > /tmp/sharegpt.json
declare -A PORT=([eagle3]=8031 [none]=8032 [alt]=8033 [altnone]=8034 [switch]=8035)
servers="eagle3 none"; [ -n "${ALT:-}" ] && servers="eagle3 alt none"; [ -n "${ALT_NONE:-}" ] && servers="$servers altnone"
[ -n "${SWITCH:-}" ] && servers="$servers switch"
policy=${SPEC_POLICY-bench/results/profile-gpu-20261130-225722.json}
if [ -n "${PROFILE:-}" ]; then  # profile this machine on the served prompts first (~2.5 min), and follow that
  python3 -m eaglet profile --model $GGUF --draft eaglet/drafters/smollm2-135m-instruct-eagle3 --prompts /tmp/sharegpt.json \
    --num-prompts ${PROFILE_PROMPTS:-16} --max-new-tokens 128 --chain-steps 7 --trees 7,4,64 \
    --batch-sizes 1 2 4 8 16 32 64 --context 256 --out "$out" 2>&1 | grep -E "^(batch|chain|tree|record)"
  policy=$(ls -t "$out"/profile-*.json | head -1)
fi
pids=()
for name in $servers; do
  spec=$name draft= dir=$PWD extra=${SERVE_ARGS:-}
  [ $name = alt ] && spec=eagle3 dir=$ALT extra=${ALT_ARGS:-}  # python -m puts the working directory first on the path
  [ $name = altnone ] && spec=none dir=$ALT extra=${ALT_NONE_ARGS:-}
  [ $name = switch ] && spec=eagle3 extra="${SERVE_ARGS:-} --spec-switch"
  [ $spec = eagle3 ] && draft="--draft $PWD/eaglet/drafters/smollm2-135m-instruct-eagle3 ${SPEC_MAX_BATCH:+--spec-max-batch $SPEC_MAX_BATCH} ${policy:+--spec-policy $(realpath $policy)} ${SPEC_ARGS:-}"
  (cd $dir && exec python3 -m eaglet serve --model $GGUF --port ${PORT[$name]} --max-batch ${MAX_BATCH:-64} --max-model-len 1024 \
    --spec $spec $draft $extra --log-level warning) &
  pids+=($!)
done
for spec in $servers; do wait_health ${PORT[$spec]} ${WAIT:-600}; done  # warm-up: 2.5-5.5 min on a fresh machine
bs() { python3 -m eaglet bench-serve --url http://127.0.0.1:${PORT[$1]} --prompts /tmp/sharegpt.json --max-tokens 128 \
         --ignore-eos --max-prompt-chars 600 --seed 0 --no-progress "${@:2}"; }
for c in ${CONC:-1 4 16 64}; do
  n=$(( c * ${PER_STREAM:-16} > 32 ? c * ${PER_STREAM:-16} : 32 ))  # requests a run: 16 a stream, at least 32
  for spec in $servers; do bs $spec --num-requests $n --concurrency $c > /dev/null; done
  for round in $(seq ${ROUNDS:-3}); do
    for spec in $servers; do
      echo "== spec $spec, concurrency $c, round $round"
      bs $spec --num-requests $n --concurrency $c --out "$out" | grep -E "throughput|TTFT|TPOT|engine|gc pauses|accept|record"
    done
    keep
  done
done
kill "${pids[@]}"; wait 2>/dev/null
save_caches
keep; echo "records: $out"
