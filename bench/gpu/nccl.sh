#!/usr/bin/env bash
# Issue 52 on one H200: NCCL's own debug log of a one-rank communicator, for the parser's fixture.
#   bash bench/gpu/nccl.sh    # eaglet env --tp 1 with NCCL_PROTO=LL NCCL_ALGO=Ring; logs in $OUT/nccl.tar
source "$(dirname "$0")/setup.sh"
set +e
out=/tmp/nccl-$$
mkdir -p "$out"
NCCL_NVLS_ENABLE=0 python3 -m eaglet env --tp 1 --nccl-env NCCL_PROTO=LL NCCL_ALGO=Ring --nccl-log-dir "$out" 2>&1 |
  tee "$out/env.txt"
tar -cf "${OUT:-/tmp}/nccl.tar" -C "$out" .
