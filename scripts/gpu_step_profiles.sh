#!/usr/bin/env bash
# Where a training step's time goes, for several settings in one device call: each argument is
# "LABEL CONFIG [--set KEY=VALUE]..."; each trains $STEPS steps (default 12) on the first
# STEPS x batch training images with `--profile 4` after 6 warm-up steps and copies the run's
# profile summary (GPU kernels and CPU operators per step) to $OUT/profile_LABEL.md, its log to
# $OUT/profile_LABEL.log.
# Usage: scripts/gpu_step_profiles.sh "gdn configs/dit_s2_fmnist.yaml --set attention.type=gated_deltanet" ...
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bin=${MHLA_BIN:-build-gpu/mhla}
steps=${STEPS:-12}
for probe in "$@"; do
  read -r label config rest <<< "$probe"
  batch=$(awk '/^  batch_size:/ {print $2; exit}' "$config")
  # shellcheck disable=SC2086
  "$bin" train "$config" $rest --set train.epochs=1 --set data.train_limit=$(( steps * batch )) \
    --set data.test_limit=1000 --set train.log_every=$(( steps / 2 )) --set run.name=profile_$label \
    --set diffusion.fid_samples=0 --set diffusion.grid_samples=0 --profile 4 --profile-warmup 6 \
    > "$OUT/profile_$label.log" 2>&1
  echo "$label: rc $?"
  cp runs/profile_$label/profile/summary.md "$OUT/profile_$label.md" 2> /dev/null
done
