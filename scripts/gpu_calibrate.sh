#!/usr/bin/env bash
# One device call: build against the machine's torch, run the whole test suite (GPU cases too),
# then one epoch of DeiT-T/2 per attention type for throughput, and the timm peer.
# Results land in $OUT (the device tool brings them back).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export MHLA_DATA_DIR=$PWD/data
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
start=$(date +%s)
scripts/build_gpu.sh > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"
(cd build-gpu && ctest --output-on-failure -j4 > "$OUT/ctest.log" 2>&1); tail -15 "$OUT/ctest.log"
for attention in mhla linear softmax; do
  build-gpu/mhla train configs/deit_t2_fmnist.yaml --set attention.type=$attention \
    --set train.epochs=1 --set train.log_every=50 --set run.name=calib_$attention \
    > "$OUT/calib_$attention.log" 2>&1
  grep -E "img/s|eval" "$OUT/calib_$attention.log" | tail -3
done
python3 -c "import sys; sys.path.insert(0, '.gpu_stage/bench'); import peers_e2e as p; p.deit(False); p.deit(True)" 2>&1 | grep -v Warning | tail -3
echo "total: $(( $(date +%s) - start )) s"
