#!/usr/bin/env bash
# One attention type of the DiT study (scripts/gpu_dit_study.sh) on a one-GPU machine, in two
# device calls made back to back: the run folder (runs/ is not tracked) stays on the warm machine
# between them. Outputs are named like gpu_dit_study.sh's, so scripts/dit_table.py reads them.
#   PHASE=train: trains the FID feature network if it is absent (15 s), then the DiT with the
#     study's recipe (training-time FID hook off, as in the study's MHLA run); copies the log,
#     metrics.jsonl and the grid into $OUT/dit_TYPE/.
#   PHASE=fid: the two 10,000-sample FID-FMNIST/KID runs (50 DDIM steps, guidance 1 and $CFG),
#     one after the other, each under its own time limit.
# Usage: PHASE=train scripts/gpu_dit_single_gpu.sh gated_deltanet; then PHASE=fid ...
# Run from the repository root after `source scripts/gpu_env.sh` (carry .gpu_stage/bin,
# .gpu_stage/lib and data/fashion-mnist). Results also tarred into $OUT/dit_TYPE.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/out}
attention=$1
V=$OUT/dit_$attention; mkdir -p "$V"
export MHLA_DATA_DIR=${MHLA_DATA_DIR:-$PWD/data}
bin=${MHLA_BIN:-build-gpu/mhla}
config=${CONFIG:-configs/dit_s2_fmnist.yaml}
name=$(basename "$config" .yaml)
run=runs/${name}_$attention
case ${PHASE:-train} in
  train)
    start=$(date +%s)
    [ -d runs/fid_net_fmnist ] || "$bin" train configs/fid_net_fmnist.yaml > "$V/fid_net.log" 2>&1
    echo "FID network ($?) $(( $(date +%s) - start )) s" | tee -a "$V/timing.txt"
    start=$(date +%s)
    "$bin" train "$config" --set attention.type=$attention --set run.name=$(basename $run) \
      --set diffusion.fid_samples=0 ${EXTRA:-} > "$V/${name}_$attention.log" 2>&1
    echo "$attention: train + final evaluation ($?) $(( $(date +%s) - start )) s" |
      tee -a "$V/timing.txt"
    cp $run/metrics.jsonl "$V/${name}_${attention}_metrics.jsonl"
    for f in $run/samples/*.png; do
      [ -e "$f" ] && cp "$f" "$V/${name}_${attention}_$(basename $f)"
    done
    tail -4 "$V/${name}_$attention.log"
    ;;
  fid)
    [ -d $run ] || { echo "$run is not on this machine: run PHASE=train first"; exit 1; }
    for cfg in 1 ${CFG:-1.5}; do
      start=$(date +%s)
      limit=$([ $cfg = 1 ] && echo ${FID_LIMIT:-220} || echo ${FID_LIMIT_CFG:-330})
      timeout $limit "$bin" eval $run --fid --n ${FID_N:-10000} --steps 50 --cfg $cfg \
        --batch ${FID_BATCH:-1000} 2> "$V/${name}_${attention}_fid_cfg$cfg.err" |
        grep '^{' > "$V/${name}_${attention}_fid_cfg$cfg.json"
      echo "$attention: FID cfg $cfg (${PIPESTATUS[0]}) $(( $(date +%s) - start )) s" |
        tee -a "$V/timing.txt"
      cat "$V/${name}_${attention}_fid_cfg$cfg.json"
    done
    ;;
esac
(cd "$OUT" && tar czf dit_$attention.tgz dit_$attention)
