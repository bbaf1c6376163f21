#!/usr/bin/env bash
# One device call after the row kernels (LayerNorm, the adaLN hinge) moved their shared pieces to
# kernels/common/row_kernels.cuh: the GPU tests of every kernel that includes it and of the models
# built on them, then 60-step training-rate probes: DiT-S/2 at 256 tokens for every attention type
# that has a study row, DiT at 1,024 tokens (softmax, MHLA) and DeiT-T/2 (MHLA).
# Run from the repository root after `source scripts/gpu_env.sh` (carry .gpu_stage/bin,
# .gpu_stage/lib and data/fashion-mnist).
# Results in $OUT/row_kernels.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/row_kernels; mkdir -p "$V"
tests=${MHLA_TESTS_BIN:-build-gpu/tests/mhla_tests}
t0=$(date +%s); step() { echo "== $1 (t=$(( $(date +%s) - t0 ))s)" | tee -a "$V/steps.txt"; }

step "tests"
for case in "layers:*" "*adaLN*" "*gated RMSNorm*" "*short conv*" "dit:*" \
    "model: DeiT and GPT with each GPU attention backend*"; do
  echo "## $case" >> "$V/tests.txt"
  timeout 200 "$tests" "$case" >> "$V/tests.txt" 2>&1
  echo "rc $?" >> "$V/tests.txt"
done
grep -E "^## |passed|failed|rc " "$V/tests.txt"
timeout 120 compute-sanitizer --tool memcheck "$tests" "layers: the residual add + norm kernel*" \
  > "$V/memcheck.txt" 2>&1
tail -1 "$V/memcheck.txt"

step "probes"
d="configs/dit_s2_fmnist.yaml --set attention.type"
OUT=$V STEPS=60 scripts/gpu_throughput_probe.sh "dit256_softmax $d=softmax" \
  "dit256_linear $d=linear" "dit256_mhla $d=mhla" "dit256_gated_deltanet $d=gated_deltanet" \
  "dit1024_softmax configs/dit_s2_fmnist64.yaml --set attention.type=softmax" \
  "dit1024_mhla configs/dit_s2_fmnist64.yaml --set attention.type=mhla" \
  "deit_mhla configs/deit_t2_fmnist.yaml --set attention.type=mhla" | tee -a "$V/probes.jsonl"
step "done"
cd "$OUT" && tar czf row_kernels.tgz row_kernels
