#!/usr/bin/env bash
# Session 22's closing device call (causal sweeps: register rings, two-element backward, the
# trained pairs in the backward sweep, sweeps past the trained length):
#   1. the causal block-linear tests (default; with the GEMM mix forced, MHLA_CAUSAL_MIX_GEMM=1;
#      with packed states, MHLA_CAUSAL_PACKED_STATES=1), the state-mixing tests, the op harness;
#      memcheck of the small-shape causal test; racecheck of causal MHLA on a sweep shape;
#   2. forward+backward at the LM shapes, two rounds, and fla's chunk_linear_attn in the same call;
#   3. GPT training probes (60 steps, configs/gpt_austen_kjv.yaml): linear and MHLA;
#   4. Nsight Compute durations per kernel of MHLA at T = 8,192 and 2,048.
# SKIP_MIXING, SKIP_SANITIZERS and ONE_ROUND shorten the call (the last one of session 22 ran
# with all three, after the same script's full run).
# Run from the repository root after `source scripts/gpu_env.sh` (carry .gpu_stage, .whl and
# data/text). Results in $OUT/final22.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/final22; mkdir -p "$V"
bin=${MHLA_BIN:-build-gpu/mhla}
tests=${MHLA_TESTS_BIN:-build-gpu/tests/mhla_tests}
source scripts/gpu_delta_checks.sh
t0=$(date +%s); step() { echo "== $1 (t=$(( $(date +%s) - t0 ))s)"; }
pack() { tar czf "$OUT/final22.tgz" -C "$OUT" final22; }

step tests
run_gpu_tests "$V" tests_causal.txt 120 "$tests" "*causal block-linear*"
MHLA_CAUSAL_MIX_GEMM=1 run_gpu_tests "$V" tests_causal_gemm.txt 120 "$tests" "*causal block-linear*"
MHLA_CAUSAL_PACKED_STATES=1 run_gpu_tests "$V" tests_causal_packed.txt 120 "$tests" \
  "*causal block-linear*"
[ -n "${SKIP_MIXING:-}" ] ||
  run_gpu_tests "$V" tests_mixing.txt 100 "$tests" "*block state mix*,*block pair products*,*fused block mix*"
run_gpu_tests "$V" tests_ops.txt 150 "$tests" "ops: every op and GPU backend*"
[ -n "${SKIP_SANITIZERS:-}" ] || timeout 100 compute-sanitizer --tool memcheck "$tests" \
  "attention: causal block-linear kernels on small odd shapes" > "$V/memcheck_causal.txt" 2>&1
echo "memcheck causal: $(grep 'ERROR SUMMARY' "$V/memcheck_causal.txt" | tail -1)"
log="$V/racecheck_mhla_1_2_2100_64.txt"
[ -n "${SKIP_SANITIZERS:-}" ] || timeout 60 compute-sanitizer --tool racecheck "$bin" bench attention --op mhla --causal \
  --backend cuda --shape 1,2,2100,64 --blocks 16 --warmup 0 --iters 1 > "$log" 2>&1
echo "racecheck mhla 1,2,2100,64 M=16: $(grep 'RACECHECK SUMMARY' "$log" | tail -1)"
pack

step bench
bench_lm "$V" lm_r1 "$bin" linear mhla
[ -n "${ONE_ROUND:-}" ] || bench_lm "$V" lm_r2 "$bin" linear mhla
# Session 23: the opt-in in-sweep trained pairs (MHLA_CAUSAL_SWEEP_PAIRS=1) against the default.
MHLA_CAUSAL_SWEEP_PAIRS=1 bench_lm "$V" lm_sweep_pairs "$bin" mhla
( source scripts/gpu_fla_env.sh
  OUT=$V timeout 200 python3 scripts/fla_linear_peer.py 2>&1 | grep '^{' | tee "$V/peers_lm.jsonl" )
pack

step gpt
OUT=$V timeout 150 bash scripts/gpu_throughput_probe.sh \
  "gpt_linear configs/gpt_austen_kjv.yaml --set attention.type=linear" \
  "gpt_mhla configs/gpt_austen_kjv.yaml --set attention.type=mhla" | tee "$V/gpt_probes.jsonl"
gzip -f "$V"/*.log 2> /dev/null
pack

if command -v ncu > /dev/null; then
  step ncu
  kernel_times "$V" "$bin" "ncu_8192_" 4,8,8192,128 12 mhla
  kernel_times "$V" "$bin" "ncu_2048_" 16,8,2048,128 12 mhla
  MHLA_CAUSAL_SWEEP_PAIRS=1 kernel_times "$V" "$bin" "ncu_2048_sweep_pairs_" 16,8,2048,128 12 mhla
  gzip -f "$V"/*.csv 2> /dev/null
fi

step done
pack && rm -rf "$V"
