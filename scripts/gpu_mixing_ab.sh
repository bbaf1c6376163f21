#!/usr/bin/env bash
# One device call for a change to the state-mixing kernels both MHLA bindings share (the pair
# products of the mixing gradient, kernels/mhla/block_pair_products.cu), against the previous
# binary:
#   1. the causal, state-mixing, bidirectional-family and op-harness [gpu] tests; memcheck of the
#      small-shape causal test and of the state-mixing tests;
#   2. forward+backward of causal linear attention and MHLA at the LM shapes and of bidirectional
#      MHLA and linear attention at the vision shapes, two rounds of the previous binary
#      (.gpu_stage/bin/mhla_prev.gz, when carried) and this one; fla's chunk_linear_attn in the
#      same call unless SKIP_PEER=1;
#   3. Nsight Compute durations per kernel of one forward+backward: causal MHLA and linear at
#      T = 2,048 and bidirectional MHLA at N = 1,024, both binaries.
# Run from the repository root after `source scripts/gpu_env.sh` (binaries from
# `scripts/stage_gpu.sh --binaries`; carry .gpu_stage, and .whl for fla). SKIP_TESTS=1 and
# SKIP_NCU=1 shorten a repeat call. Results in $OUT/mixing.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/mixing; mkdir -p "$V"
bin=${MHLA_BIN:-build-gpu/mhla}
tests=${MHLA_TESTS_BIN:-build-gpu/tests/mhla_tests}
source scripts/gpu_delta_checks.sh
t0=$(date +%s); step() { echo "== $1 (t=$(( $(date +%s) - t0 ))s)"; }
harness="ops: every op and GPU backend*"
filter="*causal block-linear*,*block state mix*,*block pair products*,*bidirectional*,$harness"
prev=""
if [ -f .gpu_stage/bin/mhla_prev.gz ]; then
  gunzip -c .gpu_stage/bin/mhla_prev.gz > /tmp/mhla_prev && chmod +x /tmp/mhla_prev && prev=/tmp/mhla_prev
fi

if [ "${SKIP_TESTS:-0}" != 1 ]; then
  step tests
  run_gpu_tests "$V" tests_default.txt 240 "$tests" "$filter"
  if command -v compute-sanitizer > /dev/null; then
    timeout 150 compute-sanitizer --tool memcheck "$tests" \
      "attention: causal block-linear kernels on small odd shapes" > "$V/memcheck.txt" 2>&1
    echo "memcheck causal: $(grep 'ERROR SUMMARY' "$V/memcheck.txt" | tail -1)"
    timeout 150 compute-sanitizer --tool memcheck "$tests" "*block state mix*,*block pair products*" \
      > "$V/memcheck_mixing.txt" 2>&1
    echo "memcheck state mixing: $(grep 'ERROR SUMMARY' "$V/memcheck_mixing.txt" | tail -1)"
  fi
fi

step bench
for round in 1 2; do
  [ -n "$prev" ] && bench_lm "$V" "prev$round" "$prev" linear mhla
  bench_lm "$V" "new$round" "$bin" linear mhla
done
vision=(--shape 256,6,256,64 --shape 64,6,1024,64 --shape 16,6,4096,64 --shape 4,6,16384,64)
for round in 1 2; do
  for label in prev new; do
    b=$bin; [ $label = prev ] && b=$prev; [ -z "$b" ] && continue
    for op in mhla linear; do
      timeout 100 "$b" bench attention --op $op --backend cuda "${vision[@]}" --blocks 16 \
        --warmup 5 --iters 20 2>> "$V/bench.err" | grep '^{' > "$V/vision_${label}${round}_$op.jsonl"
      python3 -c "import json,sys; print(sys.argv[2], ' '.join('%.3f' % json.loads(l)['fwd_bwd_ms'] for l in open(sys.argv[1])))" \
        "$V/vision_${label}${round}_$op.jsonl" "vision $label$round $op"
    done
  done
done
if [ "${SKIP_PEER:-0}" != 1 ]; then
  source scripts/gpu_fla_env.sh
  OUT=$V timeout 240 python3 scripts/fla_linear_peer.py 2>&1 | grep '^{' | tee "$V/peers_lm.jsonl"
fi

if [ "${SKIP_NCU:-0}" != 1 ] && command -v ncu > /dev/null; then
  step ncu
  kernel_times "$V" "$bin" "ncu_2048_" 16,8,2048,128 10 mhla linear
  [ -n "$prev" ] && kernel_times "$V" "$prev" "ncu_prev_2048_" 16,8,2048,128 10 mhla linear
  for label in new prev; do
    b=$bin; [ $label = prev ] && b=$prev; [ -z "$b" ] && continue
    timeout 120 ncu --clock-control none --metrics gpu__time_duration.sum --csv "$b" bench \
      attention --op mhla --backend cuda --shape 64,6,1024,64 --blocks 16 --warmup 0 --iters 1 \
      > "$V/ncu_vision_1024_mhla_$label.csv" 2> /dev/null
    python3 scripts/ncu_kernel_sums.py "$V/ncu_vision_1024_mhla_$label.csv" 10
  done
fi

step done
gzip -f "$V"/*.csv 2> /dev/null
tar czf "$OUT/mixing.tgz" -C "$OUT" mixing && rm -rf "$V"
