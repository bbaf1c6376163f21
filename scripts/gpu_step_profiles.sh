#!/usr/bin/env bash
# Where a training step's time goes, for several settings in one device call: each argument is
# "LABEL CONFIG [--set KEY=VALUE]..."; each trains $STEPS steps (default 12) and profiles 4 of
# them after 6 warm-up steps (scripts/gpu_throughput_probe.sh with PROFILE_STEPS): the profile
# summary (GPU kernels and CPU operators per step) in $OUT/profile_LABEL.md, the log in
# $OUT/probe_LABEL.log, one JSON line with the probe's rate per setting.
# Usage: scripts/gpu_step_profiles.sh "gdn configs/dit_s2_fmnist.yaml --set attention.type=gated_deltanet" ...
set -uo pipefail
STEPS=${STEPS:-12} PROFILE_STEPS=4 PROFILE_WARMUP=6 \
  exec "$(dirname "${BASH_SOURCE[0]}")/gpu_throughput_probe.sh" "$@"
