#!/usr/bin/env bash
# Times our attention kernels and the peers (../shared/bench/peers_attention.py, staged into
# .gpu_stage/bench by scripts/stage_gpu.sh) in one GPU run and writes the ratio table.
# Usage: scripts/gpu_attention_bench.sh [vision]   (build-gpu/mhla must exist; results in $OUT)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bin=${MHLA_BIN:-build-gpu/mhla}
vision_shapes=(--shape 256,6,256,64 --shape 64,6,1024,64 --shape 16,6,4096,64 --shape 4,6,16384,64)
ours="$OUT/ours_vision.jsonl"; : > "$ours"
for op in mhla linear softmax; do
  backends=(reference)
  [ "$op" != softmax ] && backends=(cuda cuda_dense reference)
  "$bin" bench attention --op $op --backend "${backends[@]}" "${vision_shapes[@]}" --blocks 16 \
    --warmup 5 --iters 20 | grep '^{' >> "$ours"
done
OUT=$OUT python3 .gpu_stage/bench/peers_attention.py vision | grep '^{' > "$OUT/peers_vision.jsonl"
python3 scripts/attention_table.py "$ours" "$OUT/peers_vision.jsonl" > "$OUT/attention_vision.md"
cat "$OUT/attention_vision.md"
