#!/usr/bin/env bash
# One device call for the DiT blocks' fused adaLN hinge (kernels/adaln, models/adaln.h):
#   1. GPU tests: the hinge kernel against float64 torch (values and every gradient), a DiT on
#      the GPU against the same DiT on the CPU, the other DiT and norm tests; the hinge test under
#      compute-sanitizer memcheck;
#   2. 60-step DiT-S/2 training-rate probes at 256 and 1,024 tokens, softmax and MHLA, with the
#      kernel and with MHLA_FUSED_ADALN=0 (the torch ops), all in this one call;
#   3. profiles of the 1,024-token MHLA and softmax steps with the kernel.
# Run from the repository root after `source scripts/gpu_env.sh` (carry .gpu_stage/bin,
# .gpu_stage/lib and data/fashion-mnist). Results in $OUT/adaln.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/adaln; mkdir -p "$V"
tests=${MHLA_TESTS_BIN:-build-gpu/tests/mhla_tests}
t0=$(date +%s); step() { echo "== $1 (t=$(( $(date +%s) - t0 ))s)" | tee -a "$V/steps.txt"; }

step "tests"
for case in "*adaLN*" "dit:*" "layers:*"; do
  echo "## $case" >> "$V/tests.txt"
  timeout 240 "$tests" "$case" >> "$V/tests.txt" 2>&1
  echo "rc $?" >> "$V/tests.txt"
done
grep -E "^## |passed|failed|rc " "$V/tests.txt"
if command -v compute-sanitizer > /dev/null; then
  step "memcheck"
  timeout 180 compute-sanitizer --tool memcheck "$tests" "*adaLN hinge kernel*" \
    > "$V/memcheck.txt" 2>&1
  tail -3 "$V/memcheck.txt"
fi

step "probes"
s256="configs/dit_s2_fmnist.yaml --set attention.type"
s1024="configs/dit_s2_fmnist64.yaml --set attention.type"
for round in 1 2; do
  OUT=$V STEPS=60 scripts/gpu_throughput_probe.sh "softmax256_r$round $s256=softmax" \
    "mhla256_r$round $s256=mhla" "softmax1024_r$round $s1024=softmax" "mhla1024_r$round $s1024=mhla" |
    tee -a "$V/probes.jsonl"
  OUT=$V STEPS=60 MHLA_FUSED_ADALN=0 scripts/gpu_throughput_probe.sh \
    "softmax256_aten_r$round $s256=softmax" "mhla256_aten_r$round $s256=mhla" \
    "softmax1024_aten_r$round $s1024=softmax" "mhla1024_aten_r$round $s1024=mhla" |
    tee -a "$V/probes.jsonl"
  [ $(( $(date +%s) - t0 )) -gt 330 ] && break
done

step "profiles"
OUT=$V STEPS=12 scripts/gpu_step_profiles.sh "mhla1024 $s1024=mhla" "softmax1024 $s1024=softmax"
head -24 "$V/profile_mhla1024.md" | cut -c1-150
step "done"
cd "$OUT" && tar czf adaln.tgz adaln
