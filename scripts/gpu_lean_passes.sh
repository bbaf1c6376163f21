#!/usr/bin/env bash
# One device call for the lean causal token passes (kernels/mhla/causal_block_linear.cu: output,
# query backward and key backward at 256 threads, two CTAs per SM, products in registers) against
# MHLA_CAUSAL_LEAN_PASSES=0 (the one-CTA-per-SM passes of sessions 7-20):
#   1. the causal, op-harness and GPT [gpu] tests; memcheck of the small-shape causal test;
#      racecheck of causal linear attention and MHLA forward+backward on small odd shapes;
#   2. forward+backward of causal linear attention and MHLA at the LM shapes, lean off and on,
#      two rounds; fla's chunk_linear_attn in the same call;
#   3. Nsight Compute durations per kernel at T = 8,192, off and on.
# Run from the repository root after `source scripts/gpu_env.sh` (carry .gpu_stage and .whl).
# Results in $OUT/lean.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/lean; mkdir -p "$V"
bin=${MHLA_BIN:-build-gpu/mhla}
tests=${MHLA_TESTS_BIN:-build-gpu/tests/mhla_tests}
source scripts/gpu_delta_checks.sh
t0=$(date +%s); step() { echo "== $1 (t=$(( $(date +%s) - t0 ))s)"; }

step tests
run_gpu_tests "$V" tests_causal.txt 200 "$tests" "*causal block-linear*"
run_gpu_tests "$V" tests_ops.txt 240 "$tests" "ops: every op and GPU backend*"
timeout 150 compute-sanitizer --tool memcheck "$tests" \
  "attention: causal block-linear kernels on small odd shapes" > "$V/memcheck_causal.txt" 2>&1
echo "memcheck causal: $(grep 'ERROR SUMMARY' "$V/memcheck_causal.txt" | tail -1)"
for op in linear mhla; do
  for shape in 1,2,200,128 2,3,150,64 1,2,100,32; do
    log="$V/racecheck_${op}_${shape//,/_}.txt"
    timeout 120 compute-sanitizer --tool racecheck "$bin" bench attention --op $op --causal \
      --backend cuda --shape $shape --blocks 4 --warmup 0 --iters 1 > "$log" 2>&1
    echo "racecheck $op $shape: $(grep 'RACECHECK SUMMARY' "$log" | tail -1)"
  done
done

step bench
for round in 1 2; do
  for lean in 0 1; do
    MHLA_CAUSAL_LEAN_PASSES=$lean bench_lm "$V" "lm_lean${lean}_r$round" "$bin" linear mhla
  done
done
source scripts/gpu_fla_env.sh
OUT=$V timeout 200 python3 scripts/fla_linear_peer.py 2>&1 | grep '^{' | tee "$V/peers_lm.jsonl"

if command -v ncu > /dev/null; then
  step ncu
  for lean in 0 1; do
    MHLA_CAUSAL_LEAN_PASSES=$lean kernel_times "$V" "$bin" "ncu_8192_lean${lean}_" 4,8,8192,128 \
      12 linear mhla
  done
fi

step done
gzip -f "$V"/*.csv 2> /dev/null
tar czf "$OUT/lean.tgz" -C "$OUT" lean && rm -rf "$V"
