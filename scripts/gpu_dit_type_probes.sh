#!/usr/bin/env bash
# DiT-S/2 training rate of every attention type in one device call: 60-step probes
# (scripts/gpu_throughput_probe.sh) of configs/dit_s2_fmnist.yaml with attention.type set to each
# of TYPES (default: softmax linear mhla gated_deltanet kda), two rounds, one JSON line each, and
# the projected time of the study's 12-epoch recipe (720,000 images) at that rate.
# Run from the repository root after `source scripts/gpu_env.sh` (carry .gpu_stage and
# data/fashion-mnist). Results in $OUT/dit_probes.jsonl.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for round in 1 2; do
  for type in ${TYPES:-softmax linear mhla gated_deltanet kda}; do
    OUT=/tmp/probe_logs STEPS=60 timeout 200 scripts/gpu_throughput_probe.sh \
      "dit_${type}_$round configs/dit_s2_fmnist.yaml --set attention.type=$type" |
      tee -a "$OUT/dit_probes.jsonl"
  done
done
python3 - "$OUT/dit_probes.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("rate"):
        print(f"{r['label']}: {r['rate']} img/s, 12 epochs (720,000 images) in {720000 / r['rate'] / 60:.1f} min")
PY
