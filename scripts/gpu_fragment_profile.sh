#!/usr/bin/env bash
# One device call about the bidirectional fragment passes (kernels/mhla/block_fragment_passes.h):
#   1. Nsight Compute sections (speed of light, occupancy, warp states, scheduler) of the four
#      fragment kernels for linear attention and MHLA at B = 64, N = 1,024, H = 6, D = 64, and
#      the SASS lines where the query pass stalls most;
#   2. N = 256: the default family (resident kernels) against the state kernels;
#   3. 60-step DiT-S/2 probes at 1,024 tokens: softmax, MHLA, linear, and MHLA with the WMMA
#      passes (MHLA_FRAGMENT_PASSES=0), when data/fashion-mnist was carried.
# Run from the repository root after `source scripts/gpu_env.sh`; results in $OUT/fragment.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/fragment; mkdir -p "$V"
b=${MHLA_BIN:-build-gpu/mhla}
echo "== ncu sections"
for op in linear mhla; do
  timeout 150 ncu --clock-control none --section SpeedOfLight --section Occupancy \
    --section WarpStateStats --section SchedulerStats --section LaunchStats -k regex:fragment \
    "$b" bench attention --op $op --backend cuda --shape 64,6,1024,64 --blocks 16 --warmup 0 \
    --iters 1 > "$V/ncu_sections_$op.txt" 2>&1
done
grep -E "fragment_|Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Issue Slots Busy|No Eligible|Memory Throughput|DRAM Throughput" \
  "$V/ncu_sections_linear.txt" | head -60
timeout 120 ncu --clock-control none --section SourceCounters --page source --print-source sass \
  --csv -k regex:fragment_query --launch-count 1 "$b" bench attention --op linear --backend cuda \
  --shape 64,6,1024,64 --warmup 0 --iters 1 > "$V/ncu_sass_query.csv" 2> /dev/null
python3 scripts/ncu_top_sass.py "$V/ncu_sass_query.csv" 25
echo "== N = 256 families"
for family in default states; do
  for op in linear mhla; do
    MHLA_BIDIRECTIONAL_KERNEL=$family timeout 60 "$b" bench attention --op $op --backend cuda \
      --shape 256,6,256,64 --blocks 16 --warmup 5 --iters 20 2> /dev/null | grep '^{' |
      python3 -c "import json,sys; [print('N=256 $family $op', '%.3f (%.3f)' % (d['fwd_bwd_ms'], d['fwd_ms'])) for d in map(json.loads, sys.stdin)]"
  done
done
if [ -d data/fashion-mnist ]; then
  echo "== DiT-1024 probes"
  s1024="configs/dit_s2_fmnist64.yaml --set attention.type"
  OUT=$V STEPS=60 scripts/gpu_throughput_probe.sh "softmax1024 $s1024=softmax" \
    "mhla1024 $s1024=mhla" "linear1024 $s1024=linear" | tee -a "$V/probes.jsonl"
  OUT=$V STEPS=60 MHLA_FRAGMENT_PASSES=0 scripts/gpu_throughput_probe.sh \
    "mhla1024_wmma $s1024=mhla" | tee -a "$V/probes.jsonl"
fi
gzip -f "$V"/*.csv 2> /dev/null
tar czf "$OUT/fragment.tgz" -C "$OUT" fragment && rm -rf "$V"
