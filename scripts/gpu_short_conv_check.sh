#!/usr/bin/env bash
# One device call for the gated delta layers' fused short conv (kernels/short_conv) and the layer
# rewrite around it:
#   1. the short-conv GPU tests, the model-level backend comparison (DeiT and GPT with every GPU
#      attention backend, gated DeltaNet and KDA included), the delta-rule tests, and the
#      clamped-norm case under compute-sanitizer memcheck;
#   2. 60-step DiT-S/2 training-rate probes (scripts/gpu_throughput_probe.sh): softmax, gated
#      DeltaNet with the kernel and with MHLA_FUSED_SHORT_CONV=0 (ATen conv and activations; the
#      projections are shared by the two directions either way), KDA;
#   3. a profile of gated DeltaNet's DiT step (scripts/gpu_step_profiles.sh).
# Run from the repository root after `source scripts/gpu_env.sh` (carry .gpu_stage/bin,
# .gpu_stage/lib and data/fashion-mnist). Results in $OUT/short_conv.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/short_conv; mkdir -p "$V"
tests=${MHLA_TESTS_BIN:-build-gpu/tests/mhla_tests}
t0=$(date +%s); step() { echo "== $1 (t=$(( $(date +%s) - t0 ))s)" | tee -a "$V/steps.txt"; }

step "tests"
for case in "*short conv*" "model: DeiT and GPT with each GPU attention backend*" "delta rule*"; do
  echo "## $case" >> "$V/tests.txt"
  timeout 300 "$tests" "$case" >> "$V/tests.txt" 2>&1
  echo "rc $?" >> "$V/tests.txt"
done
grep -E "^## |passed|failed|rc " "$V/tests.txt"
if command -v compute-sanitizer > /dev/null; then
  step "memcheck"
  timeout 120 compute-sanitizer --tool memcheck "$tests" "*where a q or k norm is clamped" \
    > "$V/memcheck.txt" 2>&1
  tail -3 "$V/memcheck.txt"
fi

step "probes"
dit="configs/dit_s2_fmnist.yaml --set attention.type"
OUT=$V STEPS=60 scripts/gpu_throughput_probe.sh "softmax $dit=softmax" "gdn $dit=gated_deltanet" \
  "kda $dit=kda" | tee -a "$V/probes.jsonl"
OUT=$V STEPS=60 MHLA_FUSED_SHORT_CONV=0 scripts/gpu_throughput_probe.sh \
  "gdn_aten_conv $dit=gated_deltanet" | tee -a "$V/probes.jsonl"

step "profile"
OUT=$V STEPS=12 scripts/gpu_step_profiles.sh "gdn $dit=gated_deltanet"
head -30 "$V/profile_gdn.md" | cut -c1-160
step "done"
cd "$OUT" && tar czf short_conv.tgz short_conv
