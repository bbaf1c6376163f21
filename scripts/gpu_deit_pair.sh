#!/usr/bin/env bash
# Two DeiT-T/2 trainings at once on a two-GPU machine (device kind nvidia-h200-x2), one per GPU,
# for recipe searches and the softmax/linear/MHLA table of issue 2. Each argument is
# "GPU NAME [--set KEY=VALUE]..." (settings on top of configs/deit_t2_fmnist.yaml). With PEER=1
# the GPU-1 job then times the PyTorch peer (../shared/bench/peers_e2e.py, eager and compiled).
# Run from the repository root after `source scripts/gpu_env.sh` (carry data/fashion-mnist and
# .gpu_stage); logs, metrics and resolved configs under $OUT/deit, tarred to $OUT/deit.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/out}; R=$OUT/deit; mkdir -p "$R"
bin=${MHLA_BIN:-build-gpu/mhla}
config=configs/deit_t2_fmnist.yaml
train() {  # GPU NAME settings...
  local gpu=$1 name=$2; shift 2
  local start=$(date +%s)
  CUDA_VISIBLE_DEVICES=$gpu "$bin" train $config "$@" --set run.name=$name > "$R/$name.log" 2>&1
  echo "$name rc=$? wall $(( $(date +%s) - start )) s: $(grep -E 'done:' "$R/$name.log")"
  cp runs/$name/metrics.jsonl "$R/${name}_metrics.jsonl" 2>/dev/null
  cp runs/$name/config.yaml "$R/${name}_config.yaml" 2>/dev/null
}
for job in "$@"; do
  read -ra words <<< "$job"
  gpu=${words[0]}
  (train "${words[@]}"
   if [ "$gpu" = 1 ] && [ "${PEER:-0}" = 1 ]; then
     CUDA_VISIBLE_DEVICES=1 timeout 150 python3 -c "import sys; sys.path.insert(0, '.gpu_stage/bench'); import peers_e2e as p; p.deit(False); p.deit(True)" 2>&1 |
       grep '^{' > "$R/e2e.jsonl"; echo "peer:"; cat "$R/e2e.jsonl"
   fi) &
done
wait
tar czf "$OUT/deit.tgz" -C "$OUT" deit
