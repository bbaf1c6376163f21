#!/usr/bin/env bash
# The causal sweeps' device check (session 22's closing call, reused since):
#   1. the causal block-linear tests (default; with the GEMM mix forced, MHLA_CAUSAL_MIX_GEMM=1;
#      with packed states, MHLA_CAUSAL_PACKED_STATES=1), the state-mixing tests, the op harness;
#      memcheck of the small-shape causal test; racecheck of causal MHLA on a sweep shape;
#   2. forward+backward at the LM shapes, two rounds, and fla's chunk_linear_attn in the same call;
#      with AB="NAME=VALUE ..." one more MHLA round and an Nsight run at T = 2,048 under those
#      switches;
#   3. GPT training probes (60 steps, configs/gpt_austen_kjv.yaml): linear and MHLA;
#   4. Nsight Compute durations per kernel of MHLA at T = 8,192 and 2,048.
# SKIP_MIXING, SKIP_SANITIZERS, SKIP_GPT and ONE_ROUND shorten the call.
# Run from the repository root after `source scripts/gpu_env.sh` (carry .gpu_stage, .whl and
# data/text). Results in $OUT/sweeps_check.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/sweeps_check; mkdir -p "$V"
bin=${MHLA_BIN:-build-gpu/mhla}
tests=${MHLA_TESTS_BIN:-build-gpu/tests/mhla_tests}
source scripts/gpu_delta_checks.sh
t0=$(date +%s); step() { echo "== $1 (t=$(( $(date +%s) - t0 ))s)"; }
pack() { tar czf "$OUT/sweeps_check.tgz" -C "$OUT" sweeps_check; }

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
# shellcheck disable=SC2086
[ -z "${AB:-}" ] || (export $AB; bench_lm "$V" lm_ab "$bin" mhla)
( source scripts/gpu_fla_env.sh
  OUT=$V timeout 200 python3 scripts/fla_linear_peer.py 2>&1 | grep '^{' | tee "$V/peers_lm.jsonl" )
pack

if [ -z "${SKIP_GPT:-}" ]; then
  step gpt
  OUT=$V timeout 150 bash scripts/gpu_throughput_probe.sh \
    "gpt_linear configs/gpt_austen_kjv.yaml --set attention.type=linear" \
    "gpt_mhla configs/gpt_austen_kjv.yaml --set attention.type=mhla" | tee "$V/gpt_probes.jsonl"
  gzip -f "$V"/*.log 2> /dev/null
  pack
fi

if command -v ncu > /dev/null; then
  step ncu
  kernel_times "$V" "$bin" "ncu_8192_" 4,8,8192,128 12 mhla
  kernel_times "$V" "$bin" "ncu_2048_" 16,8,2048,128 12 mhla
  # shellcheck disable=SC2086
  [ -z "${AB:-}" ] || (export $AB; kernel_times "$V" "$bin" "ncu_2048_ab_" 16,8,2048,128 12 mhla)
  gzip -f "$V"/*.csv 2> /dev/null
fi

step done
pack && rm -rf "$V"
