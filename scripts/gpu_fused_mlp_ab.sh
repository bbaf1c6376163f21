#!/usr/bin/env bash
# The fused GELU MLP (models/gelu_mlp.h) on the GPU: its tests, then DiT training-rate probes in
# one call: the exact GELU (torch ops), the tanh form fused into the cuBLASLt products, and the
# tanh form through the torch ops (MHLA_FUSED_MLP=0), for softmax and MHLA at 1,024 and 256
# tokens. PROFILE=1 also profiles the 1,024-token MHLA probes. Results: $OUT.
# Usage: source scripts/gpu_env.sh; OUT=... bash scripts/gpu_fused_mlp_ab.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout 300 "$MHLA_TESTS_BIN" "*GELU MLP*,*model.mlp*,*adaLN*" > "$OUT/tests.txt" 2>&1
  echo "tests rc=$? $(tail -2 "$OUT/tests.txt" | tr '\n' ' ')"
fi
probe=$here/gpu_throughput_probe.sh
for tokens in ${TOKENS:-1024 256}; do
  config=configs/dit_s2_fmnist64.yaml
  [ "$tokens" = 256 ] && config=configs/dit_s2_fmnist.yaml
  for type in softmax mhla; do
    for form in gelu gelu_tanh; do
      profile=()
      [ -n "${PROFILE:-}" ] && [ "$type" = mhla ] && [ "$tokens" = 1024 ] && profile=(PROFILE_STEPS=4)
      env "${profile[@]}" timeout 240 bash "$probe" \
        "${type}${tokens}_$form $config --set attention.type=$type --set model.mlp=$form"
    done
    MHLA_FUSED_MLP=0 timeout 240 bash "$probe" \
      "${type}${tokens}_gelu_tanh_unfused $config --set attention.type=$type --set model.mlp=gelu_tanh"
  done
done
