#!/usr/bin/env bash
# One device call for the CPE's grid-conv kernel (kernels/grid_conv, attention.cpe): its GPU
# tests, the deterministic rerun test (which trains with the CPE on), Nsight Compute times of the
# kernels at the DeiT-T/2 shape, then DeiT-T/2 training-rate probes of configs/deit_t2_fmnist.yaml
# for MHLA, softmax and linear attention under each setting, ROUNDS rounds (default 2), all in
# the same binary. SETTINGS lists "NAME:ENV=VALUE" pairs (default: the kernel and ATen's path,
# MHLA_FUSED_GRID_CONV=0), PROBE_TYPES the attention types probed (default: mhla softmax
# linear); SKIP_TESTS=1 and SKIP_NCU=1 leave those parts out.
# Run from the repository root after `source scripts/gpu_env.sh`, carrying .gpu_stage and
# data/fashion-mnist. Results: $OUT/cpe_ab/{tests.txt,ncu_summary.txt,ncu_raw.tgz,probes.jsonl}.
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/cpe_ab; mkdir -p "$V"
bin=${MHLA_BIN:-build-gpu/mhla}
tests=${MHLA_TESTS_BIN:-build-gpu/tests/mhla_tests}
read -r -a settings <<< "${SETTINGS:-kernel:MHLA_FUSED_GRID_CONV=1 aten:MHLA_FUSED_GRID_CONV=0}"
c=configs/deit_t2_fmnist.yaml
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout 300 "$tests" "*grid conv*,train: with train.deterministic two GPU runs*" > "$V/tests.txt" 2>&1
  echo "tests rc=$? $(tail -2 "$V/tests.txt" | tr '\n' ' ')"
fi
if [ -z "${SKIP_NCU:-}" ]; then
  # One training step's grid-conv launches (12 layers: forward, backward, partials' sum), each
  # timed alone by Nsight Compute (no clock locking, as in the bench).
  for s in "${settings[@]}"; do
    name=${s%%:*}
    [ "${s#*:}" = MHLA_FUSED_GRID_CONV=0 ] && continue  # ATen's path: no grid-conv kernels
    env "${s#*:}" OUT=$V bash scripts/gpu_step_ncu.sh "$name" "GridConvArgs|ConvGradients" 36 "$c"
  done | tee "$V/ncu_summary.txt"
  # The raw reports in one archive (few files come back from a device call).
  raw=$(cd "$V" && ls ncu_*.txt | grep -v '^ncu_summary.txt$')
  (cd "$V" && tar -czf ncu_raw.tgz $raw && rm -f $raw)
fi
for round in $(seq 1 "${ROUNDS:-2}"); do
  for s in "${settings[@]}"; do
    name=${s%%:*}
    probes=()
    for type in ${PROBE_TYPES:-mhla softmax linear}; do
      probes+=("${type}_${name}_r$round $c --set attention.type=$type")
    done
    env "${s#*:}" OUT=$V STEPS=${STEPS:-120} bash scripts/gpu_throughput_probe.sh "${probes[@]}"
  done
done | tee "$V/probes.jsonl"
rm -f "$V"/probe_*.log
