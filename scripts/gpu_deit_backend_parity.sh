#!/usr/bin/env bash
# Issue 3's DeiT criterion in one device call: DeiT-T/2 with MHLA (configs/deit_t2_fmnist.yaml)
# on the `cuda` backend against `reference`.
#   1. speed: STEPS-step throughput probes (scripts/gpu_throughput_probe.sh), alternating
#      reference, cuda, reference, cuda, so each backend is timed twice in the same call;
#   2. accuracy: both backends trained for EPOCHS epochs (default 14, the protocol of
#      experiments/deit_t2_fmnist.md's session 4: the full 47-epoch recipe takes the reference
#      backend longer than one device call), same config and seed, side by side on the one GPU
#      (their own rates are therefore not compared), their final test accuracies printed, and
#      their loss curves compared (scripts/compare_loss_curves.py: comparison.json).
# EXTRA adds --set options to every run. Run from the repository root after
# `source scripts/gpu_env.sh`, carrying .gpu_stage and data/fashion-mnist. Results in
# $OUT/deit_parity.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/deit_parity; mkdir -p "$V"
bin=${MHLA_BIN:-build-gpu/mhla}
config=configs/deit_t2_fmnist.yaml
epochs=${EPOCHS:-14}
extra=${EXTRA:-}
t0=$(date +%s)
tag=parity_$t0  # a fresh run folder per call: an old one would be resumed, not retrained
OUT=$V STEPS=${STEPS:-60} scripts/gpu_throughput_probe.sh \
  "reference1 $config --set attention.backend=reference $extra" \
  "cuda1 $config --set attention.backend=cuda $extra" \
  "reference2 $config --set attention.backend=reference $extra" \
  "cuda2 $config --set attention.backend=cuda $extra" | tee "$V/probes.jsonl"
echo "probes done at t=$(( $(date +%s) - t0 ))s"
for backend in reference cuda; do
  # shellcheck disable=SC2086
  timeout "${LIMIT:-400}" "$bin" train "$config" --set attention.backend=$backend \
    --set train.epochs="$epochs" --set run.name=${tag}_$backend $extra \
    > "$V/train_$backend.log" 2>&1 &
done
wait
echo "training done at t=$(( $(date +%s) - t0 ))s"
for backend in reference cuda; do
  echo "== $backend"; grep -iE "test|acc" "$V/train_$backend.log" | tail -4
  cp "runs/${tag}_$backend/metrics.jsonl" "$V/metrics_$backend.jsonl" 2> /dev/null
  cp "runs/${tag}_$backend/config.yaml" "$V/config_$backend.yaml" 2> /dev/null
done
python3 scripts/compare_loss_curves.py "$V/metrics_cuda.jsonl" "$V/metrics_reference.jsonl" \
  cuda reference | tee "$V/comparison.json"
tar czf "$OUT/deit_parity.tgz" -C "$OUT" deit_parity
