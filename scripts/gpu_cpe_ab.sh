#!/usr/bin/env bash
# One device call for the CPE's grid-conv kernel (kernels/grid_conv, attention.cpe): its GPU
# tests, the deterministic rerun test (which trains with the CPE on), then DeiT-T/2 training-rate
# probes of configs/deit_t2_fmnist.yaml for MHLA, softmax and linear attention with the kernel and
# with ATen's path (MHLA_FUSED_GRID_CONV=0), ROUNDS rounds (default 2), all in the same binary.
# Run from the repository root after `source scripts/gpu_env.sh`, carrying .gpu_stage and
# data/fashion-mnist. Results: $OUT/cpe_ab/{tests.txt,probes.jsonl}.
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/cpe_ab; mkdir -p "$V"
tests=${MHLA_TESTS_BIN:-build-gpu/tests/mhla_tests}
timeout 300 "$tests" "*grid conv*,train: with train.deterministic two GPU runs*" > "$V/tests.txt" 2>&1
echo "tests rc=$? $(tail -2 "$V/tests.txt" | tr '\n' ' ')"
c=configs/deit_t2_fmnist.yaml
for round in $(seq 1 "${ROUNDS:-2}"); do
  for fused in 1 0; do
    suffix=$([ $fused = 1 ] && echo kernel || echo aten)
    MHLA_FUSED_GRID_CONV=$fused OUT=$V STEPS=${STEPS:-120} bash scripts/gpu_throughput_probe.sh \
      "mhla_${suffix}_r$round $c" "softmax_${suffix}_r$round $c --set attention.type=softmax" \
      "linear_${suffix}_r$round $c --set attention.type=linear"
  done
done | tee "$V/probes.jsonl"
rm -f "$V"/probe_*.log
