#!/usr/bin/env bash
# The fused gated DeltaNet and KDA kernels in one device call: every [gpu] test, memcheck of
# forward+backward on small odd shapes, our forward+backward at the LM shapes, the GPT table's
# KDA and gated-DeltaNet rows (configs/gpt_austen_kjv.yaml), then fla's chunk_gated_delta_rule
# and (bounded by KDA_PEER_TIMEOUT, default 150 s: Triton compiles and autotunes it on a fresh
# machine) chunk_kda at the same shapes. Carry .gpu_stage (gzipped binaries,
# triton_cache.tgz), .whl and data/text; run after `source scripts/gpu_env.sh`. Results in
# $OUT/kda.tgz, Triton's cache in $OUT/triton_cache.tgz.part-*.
# REPEAT_OURS=1 times ours again after fla.
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/kda; mkdir -p "$V"
bin=${MHLA_BIN:-build-gpu/mhla}; tests=${MHLA_TESTS_BIN:-build-gpu/tests/mhla_tests}
source scripts/gpu_delta_checks.sh
if [ -z "${SKIP_TESTS:-}" ]; then
  run_gpu_tests "$V" gpu_tests.log 240 "$tests" "[gpu]"
  memcheck_delta "$V" "$bin"
fi
for op in kda gated_deltanet; do
  timeout 100 "$bin" bench attention --op $op --causal --backend cuda --shape 16,8,2048,128 \
    --shape 4,8,8192,128 --shape 1,8,32768,128 --warmup 3 --iters 10 2>> "$V/bench.err" |
    grep '^{' | tee -a "$V/ours_lm.jsonl"
done
[ -z "${SKIP_GPT:-}" ] && gpt_rows "$V" "$bin" 200 kda gated_deltanet
source scripts/gpu_fla_env.sh
timeout 150 python3 scripts/fla_delta_peer.py 2> "$V/peer.err" | grep '^{' | tee "$V/peers_lm.jsonl"
timeout ${KDA_PEER_TIMEOUT:-150} python3 scripts/fla_delta_peer.py --kda-only 2>> "$V/peer.err" |
  grep '^{' | tee -a "$V/peers_lm.jsonl"
tail -3 "$V/peer.err"
if [ -n "${REPEAT_OURS:-}" ]; then  # ours again after fla: brackets the peer in time
  for op in kda gated_deltanet; do
    timeout 100 "$bin" bench attention --op $op --causal --backend cuda --shape 16,8,2048,128 \
      --shape 4,8,8192,128 --shape 1,8,32768,128 --warmup 3 --iters 10 2>> "$V/bench.err" |
      grep '^{' | tee -a "$V/ours_lm_after.jsonl"
  done
fi
tar czf "$OUT/kda.tgz" -C "$OUT" kda
# Triton's cache goes back in parts of at most 15 MiB (the device returns files up to 16 MiB):
# join them with `cat triton_cache.tgz.part-* > .gpu_stage/triton_cache.tgz`.
tar czf /tmp/triton_cache.tgz -C "$TRITON_CACHE_DIR" . 2>/dev/null
split -b 15m /tmp/triton_cache.tgz "$OUT/triton_cache.tgz.part-"
