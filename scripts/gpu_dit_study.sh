#!/usr/bin/env bash
# The DiT study of experiments/dit_fmnist.md on the GPU: trains configs/dit_s2_fmnist.yaml (or
# $CONFIG) once per attention type with the same recipe and seed, then scores each run's EMA with
# FID-FMNIST (own feature network) and KID on $FID_N samples (50 DDIM steps) without guidance and
# with guidance $CFG, and writes the table. With several GPUs the attention types run side by
# side, one per GPU. The FID feature network is trained first when runs/fid_net_fmnist is absent.
# Usage: scripts/gpu_dit_study.sh softmax linear mhla   (build-gpu/mhla must exist; results in $OUT)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export MHLA_DATA_DIR=${MHLA_DATA_DIR:-$PWD/data}
bin=${MHLA_BIN:-build-gpu/mhla}
config=${CONFIG:-configs/dit_s2_fmnist.yaml}
name=$(basename "$config" .yaml)
fid_n=${FID_N:-10000}
cfg=${CFG:-1.5}
fid_batch=${FID_BATCH:-1000}
gpus=$(nvidia-smi -L 2>/dev/null | wc -l); [ "$gpus" -ge 1 ] || gpus=1
if [ ! -d runs/fid_net_fmnist ]; then
  "$bin" train configs/fid_net_fmnist.yaml > "$OUT/fid_net.log" 2>&1 || { tail -5 "$OUT/fid_net.log"; exit 1; }
fi
i=0
for attention in "$@"; do
  (
    export CUDA_VISIBLE_DEVICES=$(( i % gpus ))
    run=runs/${name}_$attention
    start=$(date +%s)
    "$bin" train "$config" --set attention.type=$attention --set run.name=$(basename $run) \
      ${EXTRA:-} > "$OUT/${name}_$attention.log" 2>&1 || exit 1
    echo "$attention: train + final evaluation $(( $(date +%s) - start )) s" | tee -a "$OUT/timing.txt"
    for w in 1 "$cfg"; do
      start=$(date +%s)
      "$bin" eval $run --fid --n $fid_n --steps 50 --cfg $w --batch $fid_batch \
        2> "$OUT/${name}_${attention}_fid_cfg$w.err" | grep '^{' > "$OUT/${name}_${attention}_fid_cfg$w.json"
      echo "$attention: FID cfg $w on $fid_n samples $(( $(date +%s) - start )) s" | tee -a "$OUT/timing.txt"
    done
    cp $run/metrics.jsonl "$OUT/${name}_${attention}_metrics.jsonl"
    for f in $run/samples/*.png; do [ -e "$f" ] && cp "$f" "$OUT/${name}_${attention}_$(basename $f)"; done
  ) &
  i=$(( i + 1 ))
  # Without a free GPU the next type waits for this one.
  [ $(( i % gpus )) -eq 0 ] && wait
done
wait
python3 scripts/dit_table.py "$OUT" "$name" "$@" > "$OUT/${name}_table.md"
cat "$OUT/${name}_table.md"
