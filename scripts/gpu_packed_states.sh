#!/usr/bin/env bash
# One device call for the packed state sets (S_j and dP_i in bf16 + fp32 z per block where the
# causal prefix is a sweep; MHLA_CAUSAL_PACKED_STATES=0 keeps them fp32):
#   1. the causal block-linear tests (packed, and unpacked), the state-mixing tests (the pair
#      products on packed sets), the op harness; memcheck of the small-shape causal test;
#      racecheck of causal linear attention and MHLA on shapes that take the sweeps;
#   2. forward+backward at the LM shapes with the packed states on / off and the sweeps' load
#      depths (AHEADS, default 8 4 16; the second round at 8 only), and fla's chunk_linear_attn in
#      the same call;
#   3. Nsight Compute durations per kernel at T = 8,192 (MHLA, linear).
# Run from the repository root after `source scripts/gpu_env.sh` (carry .gpu_stage and .whl).
# Results in $OUT/states.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/states; mkdir -p "$V"
bin=${MHLA_BIN:-build-gpu/mhla}
tests=${MHLA_TESTS_BIN:-build-gpu/tests/mhla_tests}
source scripts/gpu_delta_checks.sh
t0=$(date +%s); step() { echo "== $1 (t=$(( $(date +%s) - t0 ))s)"; }

step tests
run_gpu_tests "$V" tests_causal.txt 200 "$tests" "*causal block-linear*"
MHLA_CAUSAL_PACKED_STATES=0 run_gpu_tests "$V" tests_causal_unpacked.txt 200 "$tests" \
  "*causal block-linear*"
run_gpu_tests "$V" tests_mixing.txt 200 "$tests" "*block state mix*,*block pair products*,*fused block mix*"
run_gpu_tests "$V" tests_ops.txt 240 "$tests" "ops: every op and GPU backend*"
timeout 150 compute-sanitizer --tool memcheck "$tests" \
  "attention: causal block-linear kernels on small odd shapes" > "$V/memcheck_causal.txt" 2>&1
echo "memcheck causal: $(grep 'ERROR SUMMARY' "$V/memcheck_causal.txt" | tail -1)"
for op in linear mhla; do
  for shape in 1,2,2100,32 1,2,4200,64; do
    log="$V/racecheck_${op}_${shape//,/_}.txt"
    timeout 120 compute-sanitizer --tool racecheck "$bin" bench attention --op $op --causal \
      --backend cuda --shape $shape --blocks 4 --warmup 0 --iters 1 > "$log" 2>&1
    echo "racecheck $op $shape: $(grep 'RACECHECK SUMMARY' "$log" | tail -1)"
  done
done

step bench
# Packed states on / off at the sweeps' load depths (AHEADS: default 8 4; the second round at 8
# only); and the sweeps at every length (MHLA_CAUSAL_MIX_GEMM=0: T = 2,048 sweeps too).
for round in 1 2; do
  for packed in 1 0; do
    for ahead in ${AHEADS:-8 4}; do
      [ $round = 2 ] && [ $ahead != 8 ] && continue
      MHLA_CAUSAL_PACKED_STATES=$packed MHLA_SWEEP_AHEAD=$ahead MHLA_SWEEP_BACKWARD_AHEAD=$ahead \
        bench_lm "$V" "lm_s${packed}_a${ahead}_r$round" "$bin" linear mhla
    done
    MHLA_CAUSAL_PACKED_STATES=$packed MHLA_CAUSAL_MIX_GEMM=0 \
      bench_lm "$V" "lm_s${packed}_sweep_r$round" "$bin" mhla
  done
done
( source scripts/gpu_fla_env.sh
  OUT=$V timeout 200 python3 scripts/fla_linear_peer.py 2>&1 | grep '^{' | tee "$V/peers_lm.jsonl" )

if command -v ncu > /dev/null; then
  step ncu
  kernel_times "$V" "$bin" "ncu_8192_" 4,8,8192,128 12 mhla linear
  MHLA_CAUSAL_PACKED_STATES=0 kernel_times "$V" "$bin" "ncu_8192_s0_" 4,8,8192,128 12 mhla
  MHLA_CAUSAL_PACKED_STATES=0 MHLA_CAUSAL_MIX_GEMM=0 kernel_times "$V" "$bin" "ncu_2048_s0_sweep_" \
    16,8,2048,128 12 mhla
fi

step done
gzip -f "$V"/*.csv 2> /dev/null
tar czf "$OUT/states.tgz" -C "$OUT" states && rm -rf "$V"
