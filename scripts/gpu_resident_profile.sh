#!/usr/bin/env bash
# One device call about MHLA's resident kernels at the vision shape N = 256 (B = 256, H = 6,
# D = 64, M = 16): Nsight Compute sections (speed of light, occupancy, warp states, scheduler,
# memory) and the SASS lines where the kernel stalls most.
#   KERNEL=backward (default): the scores-form and state-form backwards (MHLA_RESIDENT_BACKWARD),
#     SASS of the state form;
#   KERNEL=forward: the mma.sync forward (MHLA_RESIDENT_FORWARD=mma) and the warpgroup forward
#     (the default since session 36), sections; SASS of the warpgroup forward;
#   KERNEL=warpgroup: the state form and the warpgroup form (the default) of the backward, SASS of
#     the warpgroup form, and its SASS listing when .gpu_stage/warpgroup.cubin was carried (a cubin
#     of kernels/mhla/resident_warpgroup_backward.cu, to check how the wgmmas are issued).
# Run from the repository root after `source scripts/gpu_env.sh`; results in $OUT/resident.tgz
# (the SASS lines with their stall samples, for scripts/ncu_top_sass.py).
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/resident; mkdir -p "$V"
b=${MHLA_BIN:-build-gpu/mhla}
shape=(--shape 256,6,256,64 --blocks 16 --warmup 0 --iters 1)
switch=MHLA_RESIDENT_BACKWARD
if [ "${KERNEL:-backward}" = forward ]; then
  switch=MHLA_RESIDENT_FORWARD; forms=(mma warpgroup); sections_kernel="resident_.*forward_kernel"
  sass_kernel=resident_warpgroup_forward
elif [ "${KERNEL:-backward}" = warpgroup ]; then
  forms=(state warpgroup); sections_kernel="resident_.*backward"
  sass_kernel=resident_warpgroup_backward
  # The listing comes from a cubin of the kernel's file compiled like the build (carried in
  # .gpu_stage, since cuobjdump over the whole binary takes minutes).
  [ -f .gpu_stage/warpgroup.cubin ] && cuobjdump -sass .gpu_stage/warpgroup.cubin > "$V/warpgroup_sass.txt" 2>&1
else
  forms=(scores state); sections_kernel="resident_.*backward"; sass_kernel=resident_state_backward
fi
for form in "${forms[@]}"; do
  env "$switch=$form" timeout 150 ncu --clock-control none \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
    --section LaunchStats --section MemoryWorkloadAnalysis -k regex:"$sections_kernel" \
    --launch-count 1 "$b" bench attention --op mhla --backend cuda "${shape[@]}" \
    > "$V/ncu_sections_${KERNEL:-backward}_form$form.txt" 2>&1
  grep -E "_kernel|Duration|Registers Per|Achieved Occupancy|Issue Slots Busy|No Eligible|Memory Throughput|DRAM Throughput|L1/TEX Hit|Mem Busy|Max Bandwidth|Bank|Warp Cycles Per Issued" \
    "$V/ncu_sections_${KERNEL:-backward}_form$form.txt" | head -30
done
env "$switch=${forms[-1]}" timeout 150 ncu --clock-control none --section SourceCounters --section WarpStateStats --page source \
  --print-source sass --csv -k regex:"$sass_kernel" --launch-count 1 "$b" bench attention \
  --op mhla --backend cuda "${shape[@]}" > "$V/ncu_sass_${KERNEL:-backward}.csv" 2> /dev/null
python3 scripts/ncu_top_sass.py "$V/ncu_sass_${KERNEL:-backward}.csv" 40
gzip -f "$V"/*.csv 2> /dev/null
tar czf "$OUT/resident.tgz" -C "$OUT" resident && rm -rf "$V"
