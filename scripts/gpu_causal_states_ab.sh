#!/usr/bin/env bash
# One device call for the causal kernels' state storage (bf16 against fp32 block-state sets,
# kernels/mhla/state_type.h) and the state-mixing kernels both MHLA bindings share:
#   1. the causal, state-mixing, bidirectional-family and op-harness [gpu] tests with the default
#      storage, the causal tests with MHLA_CAUSAL_STATES=fp32; memcheck of the small-shape causal
#      test and of the state-mixing tests;
#   2. forward+backward of causal linear attention and MHLA at the LM shapes, two rounds of:
#      the previous binary (.gpu_stage/bin/mhla_prev.gz, when carried), this one with fp32 sets,
#      this one with its default sets; then fla's chunk_linear_attn in the same call; and the
#      bidirectional vision shapes (MHLA, linear) for the previous binary and this one;
#   3. Nsight Compute durations per kernel of one MHLA forward+backward at T = 2,048 and 8,192
#      (causal) and N = 1,024 (bidirectional).
# Run from the repository root after `source scripts/gpu_env.sh` (binaries from
# `scripts/stage_gpu.sh --binaries`; carry .gpu_stage and .whl). SKIP_TESTS=1, SKIP_PEER=1 and
# SKIP_NCU=1 shorten a repeat call. Results in $OUT/states/.
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/states; mkdir -p "$V"
bin=${MHLA_BIN:-build-gpu/mhla}
tests=${MHLA_TESTS_BIN:-build-gpu/tests/mhla_tests}
source scripts/gpu_delta_checks.sh
t0=$(date +%s); step() { echo "== $1 (t=$(( $(date +%s) - t0 ))s)"; }
filter="*causal block-linear*,*block state mix*,*block pair products*,*bidirectional*,ops: every op and GPU backend*"

if [ "${SKIP_TESTS:-0}" != 1 ]; then
  step tests
  run_gpu_tests "$V" tests_bf16.txt 240 "$tests" "$filter"
  MHLA_CAUSAL_STATES=fp32 run_gpu_tests "$V" tests_fp32.txt 150 "$tests" "*causal block-linear*"
  if command -v compute-sanitizer > /dev/null; then
    timeout 150 compute-sanitizer --tool memcheck "$tests" \
      "attention: causal block-linear kernels on small odd shapes" > "$V/memcheck.txt" 2>&1
    echo "memcheck causal: $(grep 'ERROR SUMMARY' "$V/memcheck.txt" | tail -1)"
    grep -m5 -A8 "Invalid\|out of bounds" "$V/memcheck.txt" | head -40
    timeout 150 compute-sanitizer --tool memcheck "$tests" "*block state mix*,*block pair products*" \
      > "$V/memcheck_mixing.txt" 2>&1
    echo "memcheck state mixing: $(grep 'ERROR SUMMARY' "$V/memcheck_mixing.txt" | tail -1)"
  fi
fi

step bench
prev=""
if [ -f .gpu_stage/bin/mhla_prev.gz ]; then
  gunzip -c .gpu_stage/bin/mhla_prev.gz > /tmp/mhla_prev && chmod +x /tmp/mhla_prev && prev=/tmp/mhla_prev
fi
for round in 1 2; do
  [ -n "$prev" ] && bench_lm "$V" "prev$round" "$prev" linear mhla
  MHLA_CAUSAL_STATES=fp32 bench_lm "$V" "fp32_$round" "$bin" linear mhla
  bench_lm "$V" "bf16_$round" "$bin" linear mhla
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
  for shape in 16,8,2048,128 4,8,8192,128; do
    kernel_times "$V" "$bin" "ncu_${shape//,/_}_" $shape 12 mhla
  done
  timeout 120 ncu --clock-control none --metrics gpu__time_duration.sum --csv "$bin" bench \
    attention --op mhla --backend cuda --shape 64,6,1024,64 --blocks 16 --warmup 0 --iters 1 \
    > "$V/ncu_vision_1024_mhla.csv" 2> /dev/null
  python3 scripts/ncu_kernel_sums.py "$V/ncu_vision_1024_mhla.csv" 10
fi
tar czf "$OUT/states.tgz" -C "$OUT" states && rm -rf "$V"
step done
