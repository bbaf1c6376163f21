#!/usr/bin/env bash
# The fused gated-DeltaNet kernels on a GPU: their [gpu] tests and the op harness, then
# forward+backward at the LM shapes (ours, then fla's chunk_gated_delta_rule in the same call).
# Carry .gpu_stage (gzipped binaries, triton_cache.tgz) and .whl; run after
# `source scripts/gpu_env.sh`. Results in $OUT/delta.tgz (with Triton's cache packed back).
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/delta; mkdir -p "$V"
bin=${MHLA_BIN:-build-gpu/mhla}; tests=${MHLA_TESTS_BIN:-build-gpu/tests/mhla_tests}
timeout ${TEST_TIMEOUT:-150} "$tests" "delta rule: the fused*,ops: every op and GPU backend*" \
  > "$V/tests.log" 2>&1
echo "tests rc=$?"; tail -5 "$V/tests.log"
grep -B3 -A12 "FAILED" "$V/tests.log" | head -80
timeout 120 "$bin" bench attention --op gated_deltanet --causal --backend cuda \
  --shape 16,8,2048,128 --shape 4,8,8192,128 --shape 1,8,32768,128 --warmup 3 --iters 10 \
  2> "$V/ours.err" | grep '^{' | tee "$V/ours_lm.jsonl"
tail -3 "$V/ours.err"
if [ -z "${SKIP_PEER:-}" ]; then
  source scripts/gpu_fla_env.sh
  timeout ${PEER_TIMEOUT:-200} python3 scripts/fla_delta_peer.py ${PEER_ARGS:-} 2> "$V/peer.err" |
    grep '^{' | tee "$V/peers_lm.jsonl"
  tail -5 "$V/peer.err"
  tar czf "$V/triton_cache.tgz" -C "$TRITON_CACHE_DIR" . 2>/dev/null
fi
tar czf "$OUT/delta.tgz" -C "$OUT" delta
