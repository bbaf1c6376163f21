#!/usr/bin/env bash
# Compiles and autotunes fla's chunk_kda once on a fresh GPU machine (minutes of Triton work: a
# 150 s bound was not enough in session 11) and brings the Triton cache back, so that later calls
# time chunk_kda in the same call as our KDA kernels. Prints fla's KDA lines (the first timing
# after compilation, for reference only). Carry .gpu_stage (with the previous
# triton_cache.tgz, if any) and .whl; run after `source scripts/gpu_env.sh`. The cache comes
# back as $OUT/triton_cache.tgz.part-aa, -ab, ... (the device returns files of at most 16 MiB);
# join them here with `cat triton_cache.tgz.part-* > .gpu_stage/triton_cache.tgz`.
set -uo pipefail
OUT=${OUT:-/tmp/out}
source scripts/gpu_fla_env.sh
timeout "${KDA_PEER_TIMEOUT:-480}" python3 scripts/fla_delta_peer.py --kda-only 2> /tmp/kda_peer.err |
  grep '^{'
tail -3 /tmp/kda_peer.err
tar czf /tmp/triton_cache.tgz -C "$TRITON_CACHE_DIR" .
split -b 15m /tmp/triton_cache.tgz "$OUT/triton_cache.tgz.part-"
ls -la "$OUT"
