#!/usr/bin/env bash
# Warp-stall samples per SASS instruction (Nsight Compute's source counters) of chosen kernels
# of one `mhla bench attention` case, for mapping back to CUDA source lines here (the binaries
# are built with -lineinfo; scripts/sass_lines.py joins the samples with nvdisasm's line table).
#   scripts/gpu_sass_profile.sh OP SHAPE [--causal|--bidirectional] KERNEL-REGEX...
# The mode defaults to --causal (the gated-delta sessions' form). BENCH_ARGS adds bench options
# (e.g. "--blocks 16"). Writes $OUT/sass/OP_KERNEL.csv.gz. Run after `source scripts/gpu_env.sh`.
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/sass; mkdir -p "$V"
bin=${MHLA_BIN:-build-gpu/mhla}
op=$1 shape=$2; shift 2
causal=(--causal)
case "${1:-}" in
  --causal) shift ;;
  --bidirectional) causal=(); shift ;;
esac
read -r -a extra <<< "${BENCH_ARGS:-}"
for kernel in "$@"; do
  f="$V/${op}_${kernel}.csv"
  timeout 150 ncu --clock-control none --section SourceCounters --page source \
    --print-source sass --csv -k "regex:$kernel" -c 1 "$bin" bench attention --op "$op" \
    "${causal[@]}" --backend cuda --shape "$shape" "${extra[@]}" --warmup 0 --iters 1 \
    > "$f" 2> "$f.err"
  echo "$op $kernel rc=$? $(wc -l < "$f") lines"
  gzip -f "$f"
done
