#!/usr/bin/env bash
# One device call for the packed prefixes (bf16 matrix + fp32 z per block; causal_block_linear.h,
# causal_prefix_packed) and the backward sweep's load depth:
#   1. the causal (packed, and with MHLA_CAUSAL_PACKED_PREFIX=0), state-mixing and op-harness
#      [gpu] tests; memcheck of the small-shape causal test; racecheck of causal linear attention
#      and MHLA on small odd shapes;
#   2. forward+backward at the LM shapes: packed off / on, two rounds; MHLA with the backward
#      sweep's depth 1, 2, 4 (MHLA_SWEEP_BACKWARD_AHEAD); fla's chunk_linear_attn in the same call;
#   3. Nsight Compute durations per kernel at T = 8,192 and 2,048, and the speed-of-light, occupancy
#      and warp-state sections of the lean output and query-backward passes at T = 8,192.
# Run from the repository root after `source scripts/gpu_env.sh` (carry .gpu_stage and .whl).
# Results in $OUT/packed.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/packed; mkdir -p "$V"
bin=${MHLA_BIN:-build-gpu/mhla}
tests=${MHLA_TESTS_BIN:-build-gpu/tests/mhla_tests}
source scripts/gpu_delta_checks.sh
t0=$(date +%s); step() { echo "== $1 (t=$(( $(date +%s) - t0 ))s)"; }

step tests
run_gpu_tests "$V" tests_causal.txt 200 "$tests" "*causal block-linear*"
MHLA_CAUSAL_PACKED_PREFIX=0 run_gpu_tests "$V" tests_causal_unpacked.txt 200 "$tests" \
  "*causal block-linear*"
run_gpu_tests "$V" tests_mixing.txt 200 "$tests" "*block state mix*,*block pair products*,*fused block mix*"
run_gpu_tests "$V" tests_ops.txt 240 "$tests" "ops: every op and GPU backend*"
timeout 150 compute-sanitizer --tool memcheck "$tests" \
  "attention: causal block-linear kernels on small odd shapes" > "$V/memcheck_causal.txt" 2>&1
echo "memcheck causal: $(grep 'ERROR SUMMARY' "$V/memcheck_causal.txt" | tail -1)"
for op in linear mhla; do
  for shape in 1,2,200,128 2,3,150,64 1,2,2100,32; do
    log="$V/racecheck_${op}_${shape//,/_}.txt"
    timeout 120 compute-sanitizer --tool racecheck "$bin" bench attention --op $op --causal \
      --backend cuda --shape $shape --blocks 4 --warmup 0 --iters 1 > "$log" 2>&1
    echo "racecheck $op $shape: $(grep 'RACECHECK SUMMARY' "$log" | tail -1)"
  done
done

step bench
for round in 1 2; do
  for packed in 0 1; do
    MHLA_CAUSAL_PACKED_PREFIX=$packed bench_lm "$V" "lm_p${packed}_r$round" "$bin" linear mhla
  done
  for ahead in 1 2; do
    MHLA_SWEEP_BACKWARD_AHEAD=$ahead bench_lm "$V" "lm_b${ahead}_r$round" "$bin" mhla
  done
done
source scripts/gpu_fla_env.sh
OUT=$V timeout 200 python3 scripts/fla_linear_peer.py 2>&1 | grep '^{' | tee "$V/peers_lm.jsonl"

if command -v ncu > /dev/null; then
  step ncu
  kernel_times "$V" "$bin" "ncu_8192_" 4,8,8192,128 12 mhla linear
  kernel_times "$V" "$bin" "ncu_2048_" 16,8,2048,128 12 mhla
  for kernel in lean_output lean_query_backward lean_key_backward; do
    timeout 120 ncu --section SpeedOfLight --section Occupancy --section WarpStateStats \
      --section MemoryWorkloadAnalysis -k "regex:$kernel" -c 1 "$bin" bench attention --op mhla \
      --causal --backend cuda --shape 4,8,8192,128 --blocks 16 --warmup 0 --iters 1 \
      > "$V/ncu_detail_$kernel.txt" 2>&1
    grep -E "DRAM Throughput|Memory Throughput|Duration|Compute \(SM\)|Achieved Occupancy|Theoretical Occupancy|Stall|Warp Cycles Per Issued|Block Limit" \
      "$V/ncu_detail_$kernel.txt" | head -24
  done
fi

step done
gzip -f "$V"/*.csv 2> /dev/null
tar czf "$OUT/packed.tgz" -C "$OUT" packed && rm -rf "$V"
