#!/usr/bin/env bash
# Closing device call for a change to the MHLA state-mixing kernels: every [gpu] test, the vision
# table with its peers (scripts/gpu_attention_bench.sh vision), and causal linear attention and
# MHLA at the LM shapes beside fla's chunk_linear_attn, all from one binary in one call.
# Run from the repository root after `source scripts/gpu_env.sh` (carry .gpu_stage and .whl).
# Results in $OUT/final.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/final; mkdir -p "$V"
bin=${MHLA_BIN:-build-gpu/mhla}
tests=${MHLA_TESTS_BIN:-build-gpu/tests/mhla_tests}
source scripts/gpu_delta_checks.sh
t0=$(date +%s); step() { echo "== $1 (t=$(( $(date +%s) - t0 ))s)"; }

step "gpu tests"
run_gpu_tests "$V" tests_gpu.txt 330 "$tests" "[gpu]"
step "vision table"
OUT=$V/vision timeout 200 bash scripts/gpu_attention_bench.sh vision > "$V/vision.log" 2>&1
tail -8 "$V/vision.log"
step "lm"
for round in 1 2; do bench_lm "$V" "lm_r$round" "$bin" linear mhla; done
source scripts/gpu_fla_env.sh
OUT=$V timeout 150 python3 scripts/fla_linear_peer.py 2>&1 | grep '^{' | tee "$V/peers_lm.jsonl"
step done
tar czf "$OUT/final.tgz" -C "$OUT" final && rm -rf "$V"
