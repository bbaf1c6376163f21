#!/usr/bin/env bash
# DeiT-T/2 on Fashion-MNIST on the GPU: build, test, then train configs/deit_t2_fmnist.yaml with
# each attention type given (same recipe and seed). EPOCHS=auto probes MHLA's throughput first and
# picks the epoch count that fits 285 s of training. PEERS=1 also times the timm peer.
# Usage: scripts/gpu_deit_study.sh mhla [linear softmax]   (results in $OUT)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export MHLA_DATA_DIR=$PWD/data
config=configs/deit_t2_fmnist.yaml
start=$(date +%s)
if [ ! -x build-gpu/mhla ] || [ "${REBUILD:-1}" = 1 ]; then
  scripts/build_gpu.sh > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
fi
echo "build: $(( $(date +%s) - start )) s"
if [ "${TESTS:-1}" = 1 ]; then
  (cd build-gpu && ctest --output-on-failure -j4 > "$OUT/ctest.log" 2>&1); grep -E "tests passed|Failed|FAILED" "$OUT/ctest.log" | head
fi
epochs=${EPOCHS:-auto}
if [ "$epochs" = auto ]; then
  build-gpu/mhla train $config --set attention.type=mhla --set train.epochs=1 --set data.train_limit=25600 \
    --set train.log_every=25 --set run.name=probe > "$OUT/probe.log" 2>&1
  rate=$(grep -o '[0-9]* img/s' "$OUT/probe.log" | tail -1 | cut -d' ' -f1)
  epochs=$(python3 -c "print(max(1, min(40, int(285 * $rate / 59904))))")
  echo "probe: $rate img/s -> $epochs epochs"
fi
for attention in "$@"; do
  build-gpu/mhla train $config --set attention.type=$attention --set train.epochs=$epochs \
    --set run.name=deit_$attention > "$OUT/deit_$attention.log" 2>&1
  echo "$attention: rc=$?"; grep -E "eval|done" "$OUT/deit_$attention.log" | tail -4
  cp runs/deit_$attention/metrics.jsonl "$OUT/deit_${attention}_metrics.jsonl" 2>/dev/null
done
if [ "${PEERS:-0}" = 1 ]; then
  python3 -c "import sys; sys.path.insert(0, '.gpu_stage/bench'); import peers_e2e as p; p.deit(False); p.deit(True)" 2>&1 | grep '^{'
fi
echo "total: $(( $(date +%s) - start )) s"
