#!/usr/bin/env bash
# The DeiT-T/2 table of issue 2 on a two-GPU machine in one device call: GPU 0 trains MHLA then
# linear (both on the `cuda` backend), GPU 1 trains softmax and then times the PyTorch peer
# (../shared/bench/peers_e2e.py, eager and compiled) on the same GPU. Same recipe and seed for
# every run: configs/deit_t2_fmnist.yaml with the overrides in $RECIPE.
# Run from the repository root after `source scripts/gpu_env.sh` (carry data/fashion-mnist and
# .gpu_stage); results under $OUT/deit (tarred to $OUT/deit.tgz).
set -uo pipefail
OUT=${OUT:-/tmp/out}; R=$OUT/deit; mkdir -p "$R"
bin=${MHLA_BIN:-build-gpu/mhla}
config=configs/deit_t2_fmnist.yaml
RECIPE=${RECIPE:---set train.epochs=28 --set schedule.warmup_epochs=2}
train() {  # GPU, attention type, extra settings
  local gpu=$1 type=$2; shift 2
  local start=$(date +%s)
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES=$gpu "$bin" train $config $RECIPE --set attention.type=$type "$@" \
    --set run.name=deit_$type > "$R/deit_$type.log" 2>&1
  echo "$type rc=$? wall $(( $(date +%s) - start )) s: $(grep -E 'done:' "$R/deit_$type.log")"
  cp runs/deit_$type/metrics.jsonl "$R/deit_${type}_metrics.jsonl" 2>/dev/null
  cp runs/deit_$type/config.yaml "$R/deit_${type}_config.yaml" 2>/dev/null
}
(train 0 mhla --set attention.backend=cuda; train 0 linear --set attention.backend=cuda) &
(train 1 softmax
 CUDA_VISIBLE_DEVICES=1 timeout 120 python3 -c "import sys; sys.path.insert(0, '.gpu_stage/bench'); import peers_e2e as p; p.deit(False); p.deit(True)" 2>&1 |
   grep '^{' > "$R/e2e.jsonl"; echo "peer:"; cat "$R/e2e.jsonl") &
wait
tar czf "$OUT/deit.tgz" -C "$OUT" deit
