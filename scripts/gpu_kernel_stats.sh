#!/usr/bin/env bash
# Nsight Compute's summary sections (speed of light, occupancy, launch statistics, warp states,
# memory workload) for chosen kernels of one `mhla bench attention` case: what bounds each kernel.
#   scripts/gpu_kernel_stats.sh OP SHAPE [--causal|--bidirectional] KERNEL-REGEX
# Writes $OUT/stats/OP_SHAPE.txt (one instance of every matching kernel of one forward+backward).
# Run after `source scripts/gpu_env.sh`.
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/stats; mkdir -p "$V"
bin=${MHLA_BIN:-build-gpu/mhla}
op=$1 shape=$2 mode=$3 regex=$4
causal=(); [ "$mode" = "--causal" ] && causal=(--causal)
f="$V/${op}_${shape//,/x}.txt"
timeout 200 ncu --section SpeedOfLight --section Occupancy --section LaunchStats \
  --section WarpStateStats --section MemoryWorkloadAnalysis -k "regex:$regex" \
  "$bin" bench attention --op "$op" "${causal[@]}" --backend cuda --shape "$shape" \
  --warmup 0 --iters 1 > "$f" 2> "$f.err"
echo "$op $shape rc=$? $(wc -l < "$f") lines"
