#!/usr/bin/env bash
# One device call for the prefix sweeps' load depth (MHLA_SWEEP_AHEAD: blocks in flight per
# thread, the depths in $AHEADS, default "4 8 16" as in session 21's call 2; kernels/mhla/
# causal_block_linear.cu) and the lean states pass:
#   1. the causal and op-harness [gpu] tests; memcheck of the small-shape causal test;
#   2. forward+backward of causal linear attention and MHLA at the LM shapes for each depth, two
#      rounds; fla's chunk_linear_attn in the same call;
#   3. Nsight Compute durations per kernel of MHLA at T = 8,192 (first and last depth), at 32,768
#      and at 2,048.
# Run from the repository root after `source scripts/gpu_env.sh` (carry .gpu_stage and .whl).
# Results in $OUT/sweep.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/sweep; mkdir -p "$V"
bin=${MHLA_BIN:-build-gpu/mhla}
tests=${MHLA_TESTS_BIN:-build-gpu/tests/mhla_tests}
source scripts/gpu_delta_checks.sh
read -r -a aheads <<< "${AHEADS:-4 8 16}"
first=${aheads[0]}; last=${aheads[${#aheads[@]}-1]}
t0=$(date +%s); step() { echo "== $1 (t=$(( $(date +%s) - t0 ))s)"; }

step tests
for ahead in "$first" "$last"; do
  MHLA_SWEEP_AHEAD=$ahead run_gpu_tests "$V" "tests_causal_a$ahead.txt" 200 "$tests" \
    "*causal block-linear*"
done
run_gpu_tests "$V" tests_ops.txt 240 "$tests" "ops: every op and GPU backend*"
timeout 150 compute-sanitizer --tool memcheck "$tests" \
  "attention: causal block-linear kernels on small odd shapes" > "$V/memcheck_causal.txt" 2>&1
echo "memcheck causal: $(grep 'ERROR SUMMARY' "$V/memcheck_causal.txt" | tail -1)"

step bench
for round in 1 2; do
  MHLA_CAUSAL_LEAN_PASSES=0 bench_lm "$V" "lm_lean0_r$round" "$bin" linear
  for ahead in "${aheads[@]}"; do
    MHLA_SWEEP_AHEAD=$ahead bench_lm "$V" "lm_a${ahead}_r$round" "$bin" linear mhla
  done
done
source scripts/gpu_fla_env.sh
OUT=$V timeout 200 python3 scripts/fla_linear_peer.py 2>&1 | grep '^{' | tee "$V/peers_lm.jsonl"

if command -v ncu > /dev/null; then
  step ncu
  for ahead in "$first" "$last"; do
    MHLA_SWEEP_AHEAD=$ahead kernel_times "$V" "$bin" "ncu_8192_a${ahead}_" 4,8,8192,128 12 mhla
  done
  kernel_times "$V" "$bin" "ncu_32768_" 1,8,32768,128 12 mhla
  kernel_times "$V" "$bin" "ncu_2048_" 16,8,2048,128 12 mhla linear
fi

step done
gzip -f "$V"/*.csv 2> /dev/null
tar czf "$OUT/sweep.tgz" -C "$OUT" sweep && rm -rf "$V"
