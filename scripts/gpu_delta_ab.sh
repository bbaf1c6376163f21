#!/usr/bin/env bash
# A/B of the gated-delta kernels in one device call: the fused-kernel tests and the op harness
# with the new binary, memcheck on small odd shapes, then forward+backward at the LM shapes for
# the previous binary (staged as .gpu_stage/bin/mhla_prev.gz) and the new one, alternated twice,
# fla's two ops (carried Triton cache) between the rounds, and Nsight Compute durations per
# kernel for the new binary. Optional: CAUSAL_AB=1 adds causal linear and MHLA to the A/B,
# CAUSAL_BREAKDOWN=1 their kernels at T = 8,192 to the breakdown; SKIP_PEER=1 leaves fla out,
# SKIP_BREAKDOWN=1 the gated-delta breakdown. Carry .gpu_stage and .whl; run after `source scripts/gpu_env.sh`. Results in
# $OUT/ab.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/ab; mkdir -p "$V"
new=${MHLA_BIN:-build-gpu/mhla}; prev=/tmp/mhla_bin/mhla_prev
tests=${MHLA_TESTS_BIN:-build-gpu/tests/mhla_tests}
source scripts/gpu_delta_checks.sh
if [ -z "${SKIP_TESTS:-}" ]; then
  run_gpu_tests "$V" tests.log 200 "$tests" \
    "delta rule: the fused*,ops: every op and GPU backend*,attention: causal block-linear*"
  memcheck_delta "$V" "$new"
  walk_modes_delta "$V" "$new" "$tests"
fi
ops="kda gated_deltanet ${CAUSAL_AB:+linear mhla}"
bench_lm "$V" prev1 "$prev" $ops; bench_lm "$V" new1 "$new" $ops
if [ -z "${SKIP_PEER:-}" ]; then
  source scripts/gpu_fla_env.sh
  timeout 150 python3 scripts/fla_delta_peer.py --kda 2> "$V/peer.err" | grep '^{' |
    tee "$V/peers_lm.jsonl" |
    python3 -c "import json,sys; [print(d['op'], d['N'], '%.3f' % d['fwdbwd_ms']) for d in map(json.loads, sys.stdin)]"
fi
bench_lm "$V" prev2 "$prev" $ops; bench_lm "$V" new2 "$new" $ops
[ -z "${SKIP_BREAKDOWN:-}" ] &&
  kernel_times "$V" "$new" ncu_ 16,8,2048,128 16 kda gated_deltanet
[ -n "${CAUSAL_BREAKDOWN:-}" ] &&
  kernel_times "$V" "$new" ncu_causal_ 4,8,8192,128 16 linear mhla
gzip -f "$V"/*.csv 2>/dev/null
tar czf "$OUT/ab.tgz" -C "$OUT" ab
