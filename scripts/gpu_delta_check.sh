#!/usr/bin/env bash
# The fused gated-DeltaNet kernels on a GPU: their [gpu] tests and the op harness, then
# forward+backward at the LM shapes (ours, then fla's chunk_gated_delta_rule in the same call).
# Carry .gpu_stage (gzipped binaries, triton_cache.tgz) and .whl; run after
# `source scripts/gpu_env.sh`. Results in $OUT/delta.tgz (with Triton's cache packed back).
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/delta; mkdir -p "$V"
bin=${MHLA_BIN:-build-gpu/mhla}; tests=${MHLA_TESTS_BIN:-build-gpu/tests/mhla_tests}
[ -z "${SKIP_TESTS:-}" ] && timeout ${TEST_TIMEOUT:-150} "$tests" "${TESTS:-delta rule: the fused*,ops: every op and GPU backend*}" \
  > "$V/tests.log" 2>&1
echo "tests rc=$?"; tail -5 "$V/tests.log"
grep -q "All tests passed" "$V/tests.log" || [ -n "${SKIP_TESTS:-}" ] || { tar czf "$OUT/delta.tgz" -C "$OUT" delta; exit 1; }
grep -B3 -A12 "FAILED" "$V/tests.log" | head -80
[ -z "${SKIP_BENCH:-}" ] && timeout 120 "$bin" bench attention --op gated_deltanet --causal \
  --backend cuda --shape 16,8,2048,128 --shape 4,8,8192,128 --shape 1,8,32768,128 --warmup 3 --iters 10 \
  2> "$V/ours.err" | grep '^{' | tee "$V/ours_lm.jsonl"
tail -3 "$V/ours.err"
# With CAUSAL_TOO=1: also the causal linear and MHLA kernels at the LM shapes (they share the
# tensor-core product helper, kernels/common/wmma_gemm.cuh).
if [ -n "${CAUSAL_TOO:-}" ]; then
  for op in linear mhla; do
    timeout 90 "$bin" bench attention --op $op --causal --backend cuda --shape 16,8,2048,128 \
      --shape 4,8,8192,128 --shape 1,8,32768,128 --blocks 16 --warmup 3 --iters 10 \
      2>> "$V/ours.err" | grep '^{' | tee -a "$V/ours_lm.jsonl"
  done
fi
if [ -z "${SKIP_PEER:-}" ]; then
  source scripts/gpu_fla_env.sh
  timeout ${PEER_TIMEOUT:-200} python3 scripts/fla_delta_peer.py ${PEER_ARGS:-} 2> "$V/peer.err" |
    grep '^{' | tee "$V/peers_lm.jsonl"
  tail -5 "$V/peer.err"
  tar czf "$V/triton_cache.tgz" -C "$TRITON_CACHE_DIR" . 2>/dev/null
fi
# With BREAKDOWN=1: per-kernel GPU time (Nsight Compute durations) of one forward+backward at
# T = 2,048 and 32,768 (the bench's warm-up and timed calls: 2 forward, 2 forward+backward).
if [ -n "${BREAKDOWN:-}" ]; then
  for s in 16,8,2048,128 1,8,32768,128; do
    timeout 120 ncu --clock-control none --metrics gpu__time_duration.sum --csv "$bin" bench \
      attention --op gated_deltanet --causal --backend cuda --shape $s --warmup 1 --iters 1 \
      > "$V/ncu_${s//,/_}.csv" 2> /dev/null
    python3 scripts/ncu_kernel_sums.py "$V/ncu_${s//,/_}.csv" 14
  done
fi
# With GPT_GDN=1: the GPT table's gated-DeltaNet row (configs/gpt_austen_kjv.yaml; carry
# data/text) trained through the fused kernels.
if [ -n "${GPT_GDN:-}" ]; then
  timeout 300 "$bin" train configs/gpt_austen_kjv.yaml --set attention.type=gated_deltanet \
    --set run.name=gpt_gdn_fused > "$V/gpt_gdn.log" 2>&1
  echo "gpt gdn rc=$?: $(grep -E 'done:' "$V/gpt_gdn.log")"
  tail -4 "$V/gpt_gdn.log"
  cp runs/gpt_gdn_fused/metrics.jsonl "$V/gpt_gdn_metrics.jsonl" 2>/dev/null
fi
tar czf "$OUT/delta.tgz" -C "$OUT" delta
