#!/usr/bin/env bash
# Training throughput of several settings in one device call: each argument is
# "LABEL CONFIG [--set KEY=VALUE]..."; each probe trains $STEPS steps (default 60) on the first
# STEPS x batch training images, and the rate of its last progress line (steps 31..60: the
# first half, with its warm-up, excluded) is printed as one JSON line.
# With PROFILE_STEPS=N, N steps after $PROFILE_WARMUP (default 6) are also profiled and the run's
# profile summary (GPU kernels, CPU operators per step) is copied to $OUT/profile_LABEL.md.
# Usage: scripts/gpu_throughput_probe.sh "mhla configs/deit_t2_fmnist.yaml --set attention.type=mhla" ...
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bin=${MHLA_BIN:-build-gpu/mhla}
steps=${STEPS:-60}
profile=${PROFILE_STEPS:+--profile $PROFILE_STEPS --profile-warmup ${PROFILE_WARMUP:-6}}
for probe in "$@"; do
  read -r label config rest <<< "$probe"
  batch=$(awk '/^  batch_size:/ {print $2; exit}' "$config")
  # shellcheck disable=SC2086
  "$bin" train "$config" $rest --set train.epochs=1 --set data.train_limit=$(( steps * batch )) \
    --set data.test_limit=1000 --set train.log_every=$(( steps / 2 )) --set run.name=probe_$label \
    --set diffusion.fid_samples=0 --set diffusion.grid_samples=0 $profile \
    > "$OUT/probe_$label.log" 2>&1
  rc=$?
  [ -z "$profile" ] || cp runs/probe_$label/profile/summary.md "$OUT/profile_$label.md" 2> /dev/null
  rate=$(grep -oE '\| [0-9]+ (img|tok)/s' "$OUT/probe_$label.log" | tail -1 | grep -oE '[0-9]+')
  echo "{\"label\": \"$label\", \"rc\": $rc, \"rate\": ${rate:-null}, \"settings\": \"$config $rest\"}"
  [ $rc -eq 0 ] || tail -3 "$OUT/probe_$label.log"
done
