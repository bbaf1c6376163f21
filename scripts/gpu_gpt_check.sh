#!/usr/bin/env bash
# One device call that checks and times session 6's kernels for the GPT step (cross-entropy,
# fused q/k/v rotary split, residual add + LayerNorm) and the bias-free peer-matched GPT:
#   1. every [gpu] test case; compute-sanitizer memcheck of the cross-entropy, residual-norm and
#      gated-RMSNorm kernel tests;
#   2. 60-step training-rate probes: GPT softmax with each new kernel switched off in turn
#      (MHLA_FUSED_CE=0, MHLA_FUSED_QKV_ROTARY=0, MHLA_FUSED_RESIDUAL_NORM=0, all three), the
#      default, the peer's architecture (learned positions, no biases), GPT linear / MHLA (also
#      without the gated-RMSNorm kernel, MHLA_FUSED_GATED_NORM=0) / gated DeltaNet; DeiT MHLA (default and without the residual-norm fusion) and softmax;
#   3. gated DeltaNet / KDA forward+backward at the LM shapes; a profile of 10 GPT softmax steps;
#   4. the GPT table's gated DeltaNet and KDA rows (configs/gpt_austen_kjv.yaml, 4 epochs);
#   5. the GPT PyTorch peer (../shared/bench/peers_e2e.py), eager and compiled.
# Run from the repository root after `source scripts/gpu_env.sh` (binaries from
# `scripts/stage_gpu.sh --binaries`; carry .gpu_stage and data/text). Results in $OUT/gpt.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/gpt; mkdir -p "$V"
bin=${MHLA_BIN:-build-gpu/mhla}
tests=${MHLA_TESTS_BIN:-build-gpu/tests/mhla_tests}
t0=$(date +%s); step() { echo "== $1 (t=$(( $(date +%s) - t0 ))s)"; }

step tests
timeout 150 "$tests" "[gpu]" > "$V/gpu_tests.txt" 2>&1; echo "gpu tests rc=$?"
tail -3 "$V/gpu_tests.txt"; grep -B3 -A14 FAILED "$V/gpu_tests.txt" | head -80
if command -v compute-sanitizer > /dev/null; then
  for case in "train: the cross-entropy kernels*" "layers: the residual add + norm kernel*" \
              "attention: the gated RMSNorm kernels*"; do
    timeout 60 compute-sanitizer --tool memcheck "$tests" "$case" >> "$V/memcheck.txt" 2>&1
    echo "memcheck $case: $(grep 'ERROR SUMMARY' "$V/memcheck.txt" | tail -1)"
  done
fi

step probes
G=configs/gpt_austen_kjv.yaml D=configs/deit_t2_fmnist.yaml
SY="--set data.dataset=synthetic"
probe() {  # SETTING-ENV LABEL CONFIG ARGS...
  local envs=$1; shift
  # shellcheck disable=SC2086
  env $envs OUT="$V/probes" MHLA_BIN="$bin" STEPS=60 timeout 60 scripts/gpu_throughput_probe.sh "$*" |
    sed "s/^{/{\"env\": \"$envs\", /" | tee -a "$V/probes.jsonl"
}
probe "MHLA_X=1" gpt_softmax $G
probe "MHLA_FUSED_CE=0" gpt_softmax_no_ce $G
probe "MHLA_FUSED_QKV_ROTARY=0" gpt_softmax_no_split $G
probe "MHLA_FUSED_RESIDUAL_NORM=0" gpt_softmax_no_resnorm $G
probe "MHLA_FUSED_CE=0 MHLA_FUSED_QKV_ROTARY=0 MHLA_FUSED_RESIDUAL_NORM=0" gpt_softmax_none $G
probe "MHLA_X=1" gpt_softmax_peer_arch $G --set model.positions=learned --set model.bias=false
probe "MHLA_X=1" gpt_linear $G --set attention.type=linear
probe "MHLA_X=1" gpt_mhla $G --set attention.type=mhla
probe "MHLA_FUSED_GATED_NORM=0" gpt_mhla_no_gated_norm $G --set attention.type=mhla
probe "MHLA_X=1" gpt_gated_deltanet $G --set attention.type=gated_deltanet
probe "MHLA_X=1" deit_mhla $D $SY
probe "MHLA_FUSED_RESIDUAL_NORM=0" deit_mhla_no_resnorm $D $SY
probe "MHLA_X=1" deit_softmax $D $SY --set attention.type=softmax

step delta_bench
for op in gated_deltanet kda; do
  timeout 60 "$bin" bench attention --op $op --causal --backend cuda \
    --shape 16,8,2048,128 --shape 1,8,32768,128 --warmup 2 --iters 5 | grep '^{' |
    tee -a "$V/delta_bench.jsonl"
done

step gpt_table_rows
# Issue 5's table rows still missing: gated DeltaNet (and KDA) trained with the table's recipe.
for type in gated_deltanet kda; do
  timeout 200 "$bin" train $G --set attention.type=$type --set run.name=gpt_$type > "$V/gpt_$type.log" 2>&1
  echo "gpt $type rc=$?: $(grep -E 'done:' "$V/gpt_$type.log")"
  cp runs/gpt_$type/metrics.jsonl "$V/gpt_${type}_metrics.jsonl" 2>/dev/null
done

step profile
timeout 60 "$bin" train $G --set train.epochs=1 --set data.train_limit=640 \
  --set run.name=gpt_profile --profile 10 > "$V/profile_gpt.log" 2>&1
cp runs/gpt_profile/profile/summary.md "$V/profile_gpt.md" 2>/dev/null
head -30 "$V/profile_gpt.md" 2>/dev/null | cut -c1-150

step peers
timeout 60 python3 -c "import sys; sys.path.insert(0, '.gpu_stage/bench'); import peers_e2e as p; p.gpt(False); p.gpt(True)" 2>&1 |
  grep '^{' | tee "$V/peers_e2e.jsonl"
tar czf "$OUT/gpt.tgz" -C "$OUT" gpt
step done
