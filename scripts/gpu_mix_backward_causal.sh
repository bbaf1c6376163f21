#!/usr/bin/env bash
# One device call for the fused mix backward (kernels/mhla/block_mix_backward) at up to 32 blocks,
# which the causal MHLA binding now takes for its GEMM-mixed prefix (T <= 2,048 with 64-token
# blocks), against MHLA_FUSED_MIX_BACKWARD=0 (the transposed state mix and the pair products):
#   1. the state-mixing, causal, bidirectional-family and op-harness [gpu] tests; memcheck of the
#      fused kernel's test and of the small-shape causal test;
#   2. forward+backward of causal linear attention and MHLA at the LM shapes and of bidirectional
#      MHLA at the vision shapes, fused off and on, two rounds; fla's chunk_linear_attn in the
#      same call;
#   3. Nsight Compute durations per kernel of causal MHLA at T = 2,048 and bidirectional MHLA at
#      N = 1,024, off and on; racecheck of the fused kernel's shared-memory ring (both row counts).
# Run from the repository root after `source scripts/gpu_env.sh` (carry .gpu_stage and .whl).
# Results in $OUT/mix_causal.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/mix_causal; mkdir -p "$V"
bin=${MHLA_BIN:-build-gpu/mhla}
tests=${MHLA_TESTS_BIN:-build-gpu/tests/mhla_tests}
source scripts/gpu_delta_checks.sh
t0=$(date +%s); step() { echo "== $1 (t=$(( $(date +%s) - t0 ))s)"; }

step tests
run_gpu_tests "$V" tests_mixing.txt 200 "$tests" "*block state mix*,*block pair products*,*fused block mix*"
run_gpu_tests "$V" tests_causal.txt 200 "$tests" "*causal block-linear*"
run_gpu_tests "$V" tests_bidirectional.txt 200 "$tests" "*bidirectional*"
run_gpu_tests "$V" tests_ops.txt 240 "$tests" "ops: every op and GPU backend*"
timeout 150 compute-sanitizer --tool memcheck "$tests" "*fused block mix*" > "$V/memcheck.txt" 2>&1
echo "memcheck fused: $(grep 'ERROR SUMMARY' "$V/memcheck.txt" | tail -1)"
timeout 150 compute-sanitizer --tool memcheck "$tests" \
  "attention: causal block-linear kernels on small odd shapes" > "$V/memcheck_causal.txt" 2>&1
echo "memcheck causal: $(grep 'ERROR SUMMARY' "$V/memcheck_causal.txt" | tail -1)"
# racecheck of the shared-memory ring: the 32-row kernel (causal, 32 blocks) and the 16-row one.
timeout 150 compute-sanitizer --tool racecheck "$bin" bench attention --op mhla --causal \
  --backend cuda --shape 2,8,2048,128 --blocks 16 --warmup 0 --iters 1 > "$V/racecheck_32.txt" 2>&1
echo "racecheck 32 rows: $(grep 'RACECHECK SUMMARY' "$V/racecheck_32.txt" | tail -1)"
timeout 150 compute-sanitizer --tool racecheck "$bin" bench attention --op mhla --backend cuda \
  --shape 8,6,1024,64 --blocks 16 --warmup 0 --iters 1 > "$V/racecheck_16.txt" 2>&1
echo "racecheck 16 rows: $(grep 'RACECHECK SUMMARY' "$V/racecheck_16.txt" | tail -1)"

step bench
vision=(--shape 256,6,256,64 --shape 64,6,1024,64 --shape 16,6,4096,64 --shape 4,6,16384,64)
for round in 1 2; do
  for fused in 0 1; do
    MHLA_FUSED_MIX_BACKWARD=$fused bench_lm "$V" "lm_f${fused}_r$round" "$bin" linear mhla
    f="$V/vision_f${fused}_r${round}_mhla.jsonl"
    MHLA_FUSED_MIX_BACKWARD=$fused timeout 100 "$bin" bench attention --op mhla --backend cuda \
      "${vision[@]}" --blocks 16 --warmup 5 --iters 20 2>> "$V/bench.err" | grep '^{' > "$f"
    python3 -c "import json,sys; print(sys.argv[2], ' '.join('%.3f' % json.loads(l)['fwd_bwd_ms'] for l in open(sys.argv[1])))" \
      "$f" "vision fused=$fused r$round mhla"
  done
done
source scripts/gpu_fla_env.sh
OUT=$V timeout 200 python3 scripts/fla_linear_peer.py 2>&1 | grep '^{' | tee "$V/peers_lm.jsonl"

if command -v ncu > /dev/null; then
  step ncu
  for fused in 0 1; do
    MHLA_FUSED_MIX_BACKWARD=$fused kernel_times "$V" "$bin" "ncu_2048_f${fused}_" 16,8,2048,128 10 mhla
    MHLA_FUSED_MIX_BACKWARD=$fused timeout 120 ncu --clock-control none --metrics \
      gpu__time_duration.sum --csv "$bin" bench attention --op mhla --backend cuda \
      --shape 64,6,1024,64 --blocks 16 --warmup 0 --iters 1 > "$V/ncu_vision_1024_f$fused.csv" 2> /dev/null
    python3 scripts/ncu_kernel_sums.py "$V/ncu_vision_1024_f$fused.csv" 10
  done
fi

step done
gzip -f "$V"/*.csv 2> /dev/null
tar czf "$OUT/mix_causal.tgz" -C "$OUT" mix_causal && rm -rf "$V"
