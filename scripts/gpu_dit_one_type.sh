#!/usr/bin/env bash
# One attention type of the DiT study (scripts/gpu_dit_study.sh) on a two-GPU machine within one
# device call: GPU 0 trains it while GPU 1 trains the FID feature network and then runs $SIDE (a
# command, optional); afterwards the two 10,000-sample FID runs (without and with guidance) go one
# per GPU. Outputs are named like gpu_dit_study.sh's, so scripts/dit_table.py reads both.
# Usage: SIDE="..." scripts/gpu_dit_one_type.sh mhla   (MHLA_BIN, OUT as in gpu_dit_study.sh)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export MHLA_DATA_DIR=${MHLA_DATA_DIR:-$PWD/data}
bin=${MHLA_BIN:-build-gpu/mhla}
config=${CONFIG:-configs/dit_s2_fmnist.yaml}
name=$(basename "$config" .yaml)
attention=$1
run=runs/${name}_$attention
fid() {  # GPU, guidance scale, time limit in seconds
  local start=$(date +%s)
  CUDA_VISIBLE_DEVICES=$1 timeout "$3" "$bin" eval $run --fid --n ${FID_N:-10000} --steps 50 \
    --cfg $2 --batch ${FID_BATCH:-1000} 2> "$OUT/${name}_${attention}_fid_cfg$2.err" |
    grep '^{' > "$OUT/${name}_${attention}_fid_cfg$2.json"
  echo "$attention: FID cfg $2 ($?) $(( $(date +%s) - start )) s" | tee -a "$OUT/timing.txt"
}
(
  start=$(date +%s)
  # The training-time FID hook is off: the feature network is being trained beside it.
  CUDA_VISIBLE_DEVICES=0 "$bin" train "$config" --set attention.type=$attention \
    --set run.name=$(basename $run) --set diffusion.fid_samples=0 ${EXTRA:-} \
    > "$OUT/${name}_$attention.log" 2>&1
  echo "$attention: train + final evaluation ($?) $(( $(date +%s) - start )) s" | tee -a "$OUT/timing.txt"
) &
trainer=$!
(
  export CUDA_VISIBLE_DEVICES=1
  [ -d runs/fid_net_fmnist ] || "$bin" train configs/fid_net_fmnist.yaml > "$OUT/fid_net.log" 2>&1
  [ -n "${SIDE:-}" ] && bash -c "$SIDE"
) &
side=$!
wait $trainer
cp $run/metrics.jsonl "$OUT/${name}_${attention}_metrics.jsonl"
for f in $run/samples/*.png; do [ -e "$f" ] && cp "$f" "$OUT/${name}_${attention}_$(basename $f)"; done
wait $side
fid 0 1 ${FID_LIMIT:-300} &
fid 1 ${CFG:-1.5} ${FID_LIMIT:-300} &
wait
