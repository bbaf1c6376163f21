#!/usr/bin/env bash
# Nsight Compute's summary sections (speed of light, occupancy, launch statistics, warp states,
# memory workload) for chosen kernels of one `mhla bench attention` case: what bounds each kernel.
#   scripts/gpu_kernel_stats.sh OP SHAPE [--causal|--bidirectional] KERNEL-REGEX
# BENCH_ARGS adds bench options (e.g. "--blocks 16"); SECTIONS replaces the default sections.
# Writes $OUT/stats/OP_SHAPE.txt (one instance of every matching kernel of one forward+backward).
# Run after `source scripts/gpu_env.sh`.
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/stats; mkdir -p "$V"
bin=${MHLA_BIN:-build-gpu/mhla}
op=$1 shape=$2 mode=$3 regex=$4
causal=(); [ "$mode" = "--causal" ] && causal=(--causal)
f="$V/${op}_${shape//,/x}.txt"
read -r -a extra <<< "${BENCH_ARGS:-}"
read -r -a sections <<< "${SECTIONS:-SpeedOfLight Occupancy LaunchStats WarpStateStats MemoryWorkloadAnalysis}"
timeout 200 ncu --clock-control none "${sections[@]/#/--section=}" -k "regex:$regex" \
  "$bin" bench attention --op "$op" "${causal[@]}" --backend cuda --shape "$shape" \
  "${extra[@]}" --warmup 0 --iters 1 > "$f" 2> "$f.err"
echo "$op $shape rc=$? $(wc -l < "$f") lines"
