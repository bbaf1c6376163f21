#!/usr/bin/env bash
# One device call that checks and times the non-attention layer kernels (LayerNorm, residual
# add, the linear layer's bias gradient) and the Linear forward change:
#   1. the GPU test cases (all of them), and the column-sum and delta-rule chunk-recurrence tests
#      under compute-sanitizer memcheck;
#   2. 60-step training-rate probes of DeiT (MHLA, softmax), GPT (softmax) and DiT (MHLA) in
#      three settings of the same binary: ATen norm/add/bias gradient (MHLA_FUSED_NORM=0
#      MHLA_LINEAR_BIAS_KERNEL=0), our norm/add only (MHLA_LINEAR_BIAS_KERNEL=0), and the default;
#      GPT linear and MHLA once;
#   3. a profile of 10 DeiT steps (default);
#   4. the GPT and DeiT PyTorch peers (../shared/bench/peers_e2e.py), eager and compiled.
# Run from the repository root after `source scripts/gpu_env.sh` (binaries from
# `scripts/stage_gpu.sh --binaries`; carry .gpu_stage and data/text). Results tarred into
# $OUT/layers.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/layers; mkdir -p "$V"
bin=${MHLA_BIN:-build-gpu/mhla}
tests=${MHLA_TESTS_BIN:-build-gpu/tests/mhla_tests}
t0=$(date +%s); step() { echo "== $1 (t=$(( $(date +%s) - t0 ))s)"; }

step tests
timeout 240 "$tests" "[gpu]" > "$V/gpu_tests.txt" 2>&1; echo "gpu tests rc=$?"
tail -3 "$V/gpu_tests.txt"; grep -B3 -A12 FAILED "$V/gpu_tests.txt" | head -60
if command -v compute-sanitizer > /dev/null; then
  for case in "layers: the linear layer's bias-gradient kernel*" \
              "delta rule: the chunk-recurrence kernels equal the reference loop*"; do
    timeout 150 compute-sanitizer --tool memcheck "$tests" "$case" >> "$V/memcheck.txt" 2>&1
    echo "memcheck $case: $(grep 'ERROR SUMMARY' "$V/memcheck.txt" | tail -1)"
  done
fi

step probes
D=configs/deit_t2_fmnist.yaml G=configs/gpt_austen_kjv.yaml S=configs/dit_s2_fmnist.yaml
SY="--set data.dataset=synthetic"
for setting in aten nobias default; do
  case $setting in
    aten) envs="MHLA_FUSED_NORM=0 MHLA_LINEAR_BIAS_KERNEL=0" ;;
    default) envs="" ;;
    nobias) envs="MHLA_LINEAR_BIAS_KERNEL=0" ;;
  esac
  probes=("${setting}_deit_mhla $D $SY" "${setting}_deit_softmax $D $SY --set attention.type=softmax"
          "${setting}_gpt_softmax $G" "${setting}_dit_mhla $S $SY")
  # Issue 5's MHLA-vs-linear GPT throughput, once.
  [ $setting = default ] && probes+=("default_gpt_linear $G --set attention.type=linear"
                                     "default_gpt_mhla $G --set attention.type=mhla")
  # shellcheck disable=SC2086
  env $envs OUT="$V/probes" MHLA_BIN="$bin" STEPS=60 timeout 240 scripts/gpu_throughput_probe.sh \
    "${probes[@]}" |
    sed "s/^{/{\"setting\": \"$setting\", /" | tee -a "$V/probes.jsonl"
done

step profile
timeout 90 "$bin" train $D $SY --set train.epochs=1 \
  --set data.train_limit=10240 --set run.name=layers_profile_deit --profile 10 > "$V/profile_deit.log" 2>&1
cp runs/layers_profile_deit/profile/summary.md "$V/profile_deit.md" 2>/dev/null
head -24 "$V/profile_deit.md" 2>/dev/null | cut -c1-150

step peers
timeout 150 python3 -c "import sys; sys.path.insert(0, '.gpu_stage/bench'); import peers_e2e as p; p.gpt(False); p.gpt(True); p.deit(False); p.deit(True)" 2>&1 |
  grep '^{' | tee "$V/peers_e2e.jsonl"
tar czf "$OUT/layers.tgz" -C "$OUT" layers
step done
