#!/usr/bin/env bash
# The fused GELU MLP (models/gelu_mlp.h) on the GPU: its tests (under each backward form), then
# DiT training-rate probes in one call for softmax and MHLA: the exact GELU (torch ops), the tanh
# form fused (each backward form of $BACKWARDS, default "epilogue kernel") and the tanh form
# through the torch ops (MHLA_FUSED_MLP=0). TOKENS: "1024 256" by default. PROFILE=1 also
# profiles the 1,024-token MHLA probes (summaries into $OUT). ROUND=N suffixes the probes' run
# folders (a second round in one call). Results: $OUT.
# Usage: source scripts/gpu_env.sh; OUT=... bash scripts/gpu_fused_mlp_ab.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
backwards=${BACKWARDS:-epilogue kernel}
if [ -z "${SKIP_TESTS:-}" ]; then
  # The first backward form with the layers and DiT tests around the MLP, the others alone.
  filter="*GELU MLP*,*model.mlp*,*adaLN*,layers: the linear layer*,dit: the model on the GPU*"
  for backward in $backwards; do
    MHLA_FUSED_MLP_BACKWARD=$backward timeout 300 "$MHLA_TESTS_BIN" "$filter" \
      > "$OUT/tests_$backward.txt" 2>&1
    echo "tests ($backward) rc=$? $(tail -2 "$OUT/tests_$backward.txt" | tr '\n' ' ')"
    filter="*GELU MLP*"
  done
fi
probe=$here/gpu_throughput_probe.sh
for tokens in ${TOKENS:-1024 256}; do
  config=configs/dit_s2_fmnist64.yaml
  [ "$tokens" = 256 ] && config=configs/dit_s2_fmnist.yaml
  for type in softmax mhla; do
    run() {  # LABEL SETTINGS ENV...
      local label=$1 settings=$2; shift 2
      local profile=()
      [ -n "${PROFILE:-}" ] && [ "$type" = mhla ] && [ "$tokens" = 1024 ] && profile=(PROFILE_STEPS=4)
      env "$@" "${profile[@]}" timeout 240 bash "$probe" "$label${ROUND:+_r$ROUND} $config $settings"
    }
    run "${type}${tokens}_gelu" "--set attention.type=$type --set model.mlp=gelu"
    for backward in $backwards; do
      run "${type}${tokens}_tanh_$backward" "--set attention.type=$type --set model.mlp=gelu_tanh" \
        MHLA_FUSED_MLP_BACKWARD=$backward
    done
    [ -n "${SKIP_UNFUSED:-}" ] || run "${type}${tokens}_tanh_unfused" \
      "--set attention.type=$type --set model.mlp=gelu_tanh" MHLA_FUSED_MLP=0
  done
done
