#!/usr/bin/env bash
# A/B of the short-conv kernel's grouped loads (MHLA_SHORT_CONV_GROUP, default 4) in one short
# device call: the short-conv GPU tests with groups of 4 and of 1, then 60-step DiT-S/2 gated
# DeltaNet probes with each group size, and 40-step GPT probes (configs/gpt_austen_kjv.yaml) of
# gated DeltaNet with the kernel (groups of 4) and with ATen's conv (MHLA_FUSED_SHORT_CONV=0).
# Run from the repository root after `source scripts/gpu_env.sh` (carry .gpu_stage/bin,
# .gpu_stage/lib, data/fashion-mnist and data/text's shards and tokenizer). Results in
# $OUT/short_conv_ab.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/short_conv_ab; mkdir -p "$V"
tests=${MHLA_TESTS_BIN:-build-gpu/tests/mhla_tests}
for g in 4 1; do
  MHLA_SHORT_CONV_GROUP=$g timeout 60 "$tests" "*short conv*" > "$V/tests_group$g.txt" 2>&1
  echo "tests, groups of $g: rc $? $(grep -E 'passed|failed' "$V/tests_group$g.txt" | tail -1)"
done
dit="configs/dit_s2_fmnist.yaml --set attention.type=gated_deltanet"
gpt="configs/gpt_austen_kjv.yaml --set attention.type=gated_deltanet"
for g in 4 1; do
  MHLA_SHORT_CONV_GROUP=$g OUT=$V STEPS=60 timeout 60 scripts/gpu_throughput_probe.sh \
    "dit_gdn_group$g $dit" | tee -a "$V/probes.jsonl"
done
OUT=$V STEPS=40 timeout 50 scripts/gpu_throughput_probe.sh "gpt_gdn_group4 $gpt" |
  tee -a "$V/probes.jsonl"
MHLA_FUSED_SHORT_CONV=0 OUT=$V STEPS=40 timeout 50 scripts/gpu_throughput_probe.sh \
  "gpt_gdn_aten_conv $gpt" | tee -a "$V/probes.jsonl"
cd "$OUT" && tar czf short_conv_ab.tgz short_conv_ab
