#!/usr/bin/env bash
# A/B of the adaLN hinge's two backward kernels (kernels/adaln) in one device call: the hinge
# tests and memcheck with the staged kernel (MHLA_ADALN_STAGED=1), then 60-step DiT probes at
# 1,024 and 256 tokens and step profiles at 1,024 tokens with each kernel.
# Run from the repository root after `source scripts/gpu_env.sh` (carry .gpu_stage/bin,
# .gpu_stage/lib and data/fashion-mnist). Results in $OUT/adaln_ab.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/adaln_ab; mkdir -p "$V"
tests=${MHLA_TESTS_BIN:-build-gpu/tests/mhla_tests}
t0=$(date +%s); step() { echo "== $1 (t=$(( $(date +%s) - t0 ))s)" | tee -a "$V/steps.txt"; }

step "tests"
for staged in 1 0; do
  echo "## staged=$staged" >> "$V/tests.txt"
  MHLA_ADALN_STAGED=$staged timeout 120 "$tests" "*adaLN*" >> "$V/tests.txt" 2>&1
  echo "rc $?" >> "$V/tests.txt"
done
grep -E "^## |passed|failed|rc " "$V/tests.txt"
MHLA_ADALN_STAGED=1 timeout 120 compute-sanitizer --tool memcheck "$tests" "*adaLN hinge kernel*" \
  > "$V/memcheck.txt" 2>&1
tail -2 "$V/memcheck.txt"

step "probes"
s256="configs/dit_s2_fmnist.yaml --set attention.type"
s1024="configs/dit_s2_fmnist64.yaml --set attention.type"
for round in 1 2; do
  for staged in 0 1; do
    OUT=$V STEPS=60 MHLA_ADALN_STAGED=$staged scripts/gpu_throughput_probe.sh \
      "mhla1024_s${staged}_r$round $s1024=mhla" "softmax256_s${staged}_r$round $s256=softmax" |
      tee -a "$V/probes.jsonl"
  done
done

step "profiles"
for staged in 0 1; do
  OUT=$V STEPS=12 MHLA_ADALN_STAGED=$staged scripts/gpu_step_profiles.sh "mhla1024_s$staged $s1024=mhla"
  grep -E "AdaLn|GPU activity" "$V/profile_mhla1024_s$staged.md" | cut -c1-160
done
step "done"
cd "$OUT" && tar czf adaln_ab.tgz adaln_ab
