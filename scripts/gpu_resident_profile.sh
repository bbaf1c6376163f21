#!/usr/bin/env bash
# One device call about MHLA's resident backward at the vision shape N = 256 (B = 256, H = 6,
# D = 64, M = 16): Nsight Compute sections (speed of light, occupancy, warp states, scheduler,
# memory) of the scores form (MHLA_RESIDENT_STATE_BACKWARD=0) and the state form, and the SASS
# lines where the state form stalls most. Run from the repository root after
# `source scripts/gpu_env.sh`; results in $OUT/resident.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/resident; mkdir -p "$V"
b=${MHLA_BIN:-build-gpu/mhla}
shape=(--shape 256,6,256,64 --blocks 16 --warmup 0 --iters 1)
for form in 0 1; do
  MHLA_RESIDENT_STATE_BACKWARD=$form timeout 150 ncu --clock-control none --section SpeedOfLight \
    --section Occupancy --section WarpStateStats --section SchedulerStats --section LaunchStats \
    --section MemoryWorkloadAnalysis -k regex:resident_.*backward "$b" bench attention --op mhla \
    --backend cuda "${shape[@]}" > "$V/ncu_sections_form$form.txt" 2>&1
  grep -E "backward_kernel|Duration|Registers Per|Achieved Occupancy|Issue Slots Busy|No Eligible|Memory Throughput|DRAM Throughput|L1/TEX Hit|Mem Busy|Max Bandwidth|Bank" \
    "$V/ncu_sections_form$form.txt" | head -30
  grep -A40 "Warp State Statistics" "$V/ncu_sections_form$form.txt" | grep -iE "stall|cycles" | head -12
done
timeout 150 ncu --clock-control none --section SourceCounters --section WarpStateStats --page source \
  --print-source sass --csv -k regex:resident_state_backward --launch-count 1 "$b" bench attention \
  --op mhla --backend cuda "${shape[@]}" > "$V/ncu_sass_state.csv" 2> /dev/null
python3 scripts/ncu_top_sass.py "$V/ncu_sass_state.csv" 40
gzip -f "$V"/*.csv 2> /dev/null
tar czf "$OUT/resident.tgz" -C "$OUT" resident && rm -rf "$V"
