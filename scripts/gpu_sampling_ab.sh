#!/usr/bin/env bash
# Final device call of session 19: every [gpu] test, then DiT sampling speed with the adaLN hinge
# kernel and with MHLA_FUSED_ADALN=0 (torch ops) on the same checkpoint: a short MHLA DiT-S/2 run
# (one epoch on 5,120 images; its quality is not the point), the FID network, and
# `mhla eval RUN --fid --n $N` (50 DDIM steps) unguided and guided, timed by the JSON's
# sample_seconds.
# Run from the repository root after `source scripts/gpu_env.sh` (carry .gpu_stage/bin,
# .gpu_stage/lib and data/fashion-mnist). Results in $OUT/sampling.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/sampling; mkdir -p "$V"
bin=${MHLA_BIN:-build-gpu/mhla}; tests=${MHLA_TESTS_BIN:-build-gpu/tests/mhla_tests}
export MHLA_DATA_DIR=${MHLA_DATA_DIR:-$PWD/data}
t0=$(date +%s); step() { echo "== $1 (t=$(( $(date +%s) - t0 ))s)" | tee -a "$V/steps.txt"; }

step "gpu tests"
timeout 300 "$tests" "[gpu]" > "$V/gpu_tests.txt" 2>&1; echo "gpu tests rc=$?"
tail -3 "$V/gpu_tests.txt"

step "train"
"$bin" train configs/fid_net_fmnist.yaml > "$V/fid_net.log" 2>&1; echo "fid net rc=$?"
"$bin" train configs/dit_s2_fmnist.yaml --set attention.type=mhla --set run.name=dit_short \
  --set train.epochs=1 --set data.train_limit=5120 --set diffusion.fid_samples=0 \
  > "$V/dit_short.log" 2>&1; echo "dit rc=$?"

step "sampling"
for cfg in 1 1.5; do
  for fused in 1 0; do
    MHLA_FUSED_ADALN=$fused timeout 150 "$bin" eval runs/dit_short --fid --n ${N:-5000} --steps 50 \
      --cfg $cfg --batch 1000 2> "$V/fid_cfg${cfg}_fused$fused.err" | grep '^{' |
      tee "$V/fid_cfg${cfg}_fused$fused.json" | grep -oE '"(fid_fmnist|sample_seconds)":[0-9.]+' |
      tr '\n' ' '
    echo "<- cfg $cfg fused $fused"
  done
done
step "done"
cd "$OUT" && tar czf sampling.tgz sampling
