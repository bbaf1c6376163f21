#!/usr/bin/env bash
# DeiT-T/2 recipes trained to a time budget, one per GPU (device kinds nvidia-h200-x2/-x4): each
# job first trains one epoch of its recipe to measure its rate (img/s, last progress line), then
# sets train.epochs so the steps take BUDGET_S seconds (default 280: with evaluations and
# checkpoints the run's own clock stays under five minutes) and trains. A job whose probe fails
# with train.cuda_graph=true is probed again without graphs. Each argument is
# "GPU NAME [--set KEY=VALUE]..." on top of configs/deit_t2_fmnist.yaml. Run from the repository
# root after `source scripts/gpu_env.sh` (carry data/fashion-mnist and .gpu_stage); logs, metrics
# and resolved configs under $OUT/deit, tarred to $OUT/deit.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/out}; R=$OUT/deit; mkdir -p "$R"
bin=${MHLA_BIN:-build-gpu/mhla}
config=configs/deit_t2_fmnist.yaml
budget=${BUDGET_S:-280}
rate_of() { grep -oE '\| [0-9]+ img/s' "$1" | tail -1 | grep -oE '[0-9]+'; }
job() {  # GPU NAME settings...
  local gpu=$1 name=$2; shift 2
  local settings=("$@")
  probe() {  # [suffix]
    CUDA_VISIBLE_DEVICES=$gpu timeout 120 "$bin" train $config "${settings[@]}" \
      --set train.epochs=1 --set train.log_every=50 --set train.eval_every=0 \
      --set run.name=${name}_probe${1:-} > "$R/${name}_probe${1:-}.log" 2>&1
  }
  if ! probe; then
    echo "$name: probe failed: $(grep -m1 -iE "error|fail" "$R/${name}_probe.log")"
    mv "$R/${name}_probe.log" "$R/${name}_probe_graph_failed.log"
    settings+=(--set train.cuda_graph=false)
    probe _eager || { echo "$name: probe without graphs failed too"; return; }
    mv "$R/${name}_probe_eager.log" "$R/${name}_probe.log"
  fi
  local rate; rate=$(rate_of "$R/${name}_probe.log")
  local epochs=$(( budget * rate / 60000 ))
  echo "$name: probe $rate img/s -> $epochs epochs"
  local start=$(date +%s)
  CUDA_VISIBLE_DEVICES=$gpu "$bin" train $config "${settings[@]}" --set train.epochs=$epochs \
    --set run.name=$name > "$R/$name.log" 2>&1
  echo "$name rc=$? wall $(( $(date +%s) - start )) s: $(grep -E 'done:' "$R/$name.log")"
  cp runs/$name/metrics.jsonl "$R/${name}_metrics.jsonl" 2>/dev/null
  cp runs/$name/config.yaml "$R/${name}_config.yaml" 2>/dev/null
}
for spec in "$@"; do
  read -ra words <<< "$spec"
  job "${words[@]}" &
done
wait
tar czf "$OUT/deit.tgz" -C "$OUT" deit
