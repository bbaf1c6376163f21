#!/usr/bin/env bash
# Times our attention ops and the peers (../shared/bench/peers_attention.py, staged into
# .gpu_stage/bench by scripts/stage_gpu.sh) in one GPU run and writes the ratio table.
# Usage: scripts/gpu_attention_bench.sh [vision|lm]   (results in $OUT)
#   vision: bidirectional linear/MHLA (cuda, cuda_dense, reference) and softmax at the vision
#           shapes (B*N = 65,536, H = 6, D = 64), and the peers' GPU work (peer_gpu_time.py)
#           -> attention_vision.md
#   lm:     causal softmax, linear, MHLA (reference, cuda_dense), gated DeltaNet and KDA
#           (reference, cuda) at the LM shapes (B*T = 32,768, H = 8, D = 128) beside SDPA and fla ->
#           attention_lm.md. fla comes from wheels in .whl (carry it; see the README's "GPU build"),
#           installed without dependencies into /tmp/site. PEER_TIMEOUT (default 300 s) bounds
#           the peer script; the lines it printed before the limit are kept. Triton's compile
#           cache comes back as $OUT/triton_cache.tgz (stage it as .gpu_stage/triton_cache.tgz to
#           skip recompiling fla's kernels next time).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bin=${MHLA_BIN:-build-gpu/mhla}
mode=${1:-vision}
if [ "$mode" = lm ]; then
  lm_shapes=(--shape 16,8,2048,128 --shape 4,8,8192,128 --shape 1,8,32768,128)
  ours="$OUT/ours_lm.jsonl"; : > "$ours"
  for op in softmax linear mhla gated_deltanet kda; do
    backends=(reference)
    case $op in
      linear|mhla) backends=(reference cuda_dense) ;;
      gated_deltanet|kda) backends=(reference cuda) ;;
    esac
    "$bin" bench attention --op $op --causal --backend "${backends[@]}" "${lm_shapes[@]}" \
      --blocks 16 --warmup 2 --iters 5 | grep '^{' >> "$ours"
  done
  # The peer script appends each line to $OUT/anchors.jsonl as it goes: a time limit (fla's first
  # Triton compilations can take minutes on a fresh machine) keeps what finished before it.
  # Triton's compile cache travels between sessions: a .gpu_stage/triton_cache.tgz from an earlier
  # call (copy $OUT/triton_cache.tgz there) is unpacked first, and the cache is packed again after.
  source scripts/gpu_fla_env.sh
  : > "$OUT/anchors.jsonl"
  OUT=$OUT timeout "${PEER_TIMEOUT:-300}" python3 .gpu_stage/bench/peers_attention.py lm > /dev/null 2>&1 ||
    echo "peers_attention.py lm stopped (exit $?): the table has what it printed before"
  tar czf "$OUT/triton_cache.tgz" -C "$TRITON_CACHE_DIR" . && du -h "$OUT/triton_cache.tgz"
  grep '"kind": "lm"' "$OUT/anchors.jsonl" > "$OUT/peers_lm.jsonl"
  python3 scripts/lm_attention_table.py "$ours" "$OUT/peers_lm.jsonl" > "$OUT/attention_lm.md"
  cat "$OUT/attention_lm.md"
  exit 0
fi
vision_shapes=(--shape 256,6,256,64 --shape 64,6,1024,64 --shape 16,6,4096,64 --shape 4,6,16384,64)
ours="$OUT/ours_vision.jsonl"; : > "$ours"
for op in mhla linear softmax; do
  backends=(reference)
  [ "$op" != softmax ] && backends=(cuda cuda_dense reference)
  "$bin" bench attention --op $op --backend "${backends[@]}" "${vision_shapes[@]}" --blocks 16 \
    --warmup 5 --iters 20 | grep '^{' >> "$ours"
done
OUT=$OUT python3 .gpu_stage/bench/peers_attention.py vision | grep '^{' > "$OUT/peers_vision.jsonl"
# How much of each peer's time is GPU work (a host-bound peer's time follows the host CPU).
python3 scripts/peer_gpu_time.py .gpu_stage/bench | grep '^{' > "$OUT/peers_vision_gpu_time.jsonl"
python3 scripts/attention_table.py "$ours" "$OUT/peers_vision.jsonl" \
  "$OUT/peers_vision_gpu_time.jsonl" > "$OUT/attention_vision.md"
cat "$OUT/attention_vision.md"
