#!/usr/bin/env bash
# One device call for the fused backward of bidirectional MHLA's state mix
# (kernels/mhla/block_mix_backward: dS and dm in one pass), against the two kernels it replaces
# (MHLA_FUSED_MIX_BACKWARD=0: the transposed state mix, then the pair products), in one binary:
#   1. the state-mixing, bidirectional-family and op-harness [gpu] tests; memcheck of the fused
#      kernel's test, racecheck of one bidirectional MHLA forward+backward;
#   2. forward+backward of bidirectional MHLA and linear attention at the vision shapes, fused
#      off and on, two rounds; the vision peers (plain-PyTorch MHLA, SDPA) in the same call;
#   3. Nsight Compute durations per kernel of MHLA at N = 1,024, off and on;
#   4. 60-step DiT-S/2 probes at 1,024 tokens with MHLA, off and on (data/fashion-mnist carried).
# Run from the repository root after `source scripts/gpu_env.sh` (carry .gpu_stage/bin,
# .gpu_stage/lib, .gpu_stage/bench and data/fashion-mnist). Results in $OUT/mix_backward.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/mix_backward; mkdir -p "$V"
bin=${MHLA_BIN:-build-gpu/mhla}
tests=${MHLA_TESTS_BIN:-build-gpu/tests/mhla_tests}
source scripts/gpu_delta_checks.sh
t0=$(date +%s); step() { echo "== $1 (t=$(( $(date +%s) - t0 ))s)"; }

if [ "${SKIP_TESTS:-0}" != 1 ]; then
  step tests
  run_gpu_tests "$V" tests_mixing.txt 200 "$tests" "*block state mix*,*block pair products*,*fused block mix*"
  run_gpu_tests "$V" tests_bidirectional.txt 200 "$tests" "*bidirectional*"
  run_gpu_tests "$V" tests_ops.txt 240 "$tests" "ops: every op and GPU backend*"
  timeout 150 compute-sanitizer --tool memcheck "$tests" "*fused block mix*" > "$V/memcheck.txt" 2>&1
  echo "memcheck fused: $(grep 'ERROR SUMMARY' "$V/memcheck.txt" | tail -1)"
  timeout 150 compute-sanitizer --tool racecheck "$bin" bench attention --op mhla --backend cuda \
    --shape 8,6,1024,64 --blocks 16 --warmup 0 --iters 1 > "$V/racecheck.txt" 2>&1
  echo "racecheck: $(grep 'RACECHECK SUMMARY\|ERROR SUMMARY' "$V/racecheck.txt" | tail -1)"
fi

step bench
vision=(--shape 256,6,256,64 --shape 64,6,1024,64 --shape 16,6,4096,64 --shape 4,6,16384,64)
for round in 1 2; do
  for fused in 0 1; do
    for op in mhla linear; do
      f="$V/vision_f${fused}_r${round}_$op.jsonl"
      MHLA_FUSED_MIX_BACKWARD=$fused timeout 100 "$bin" bench attention --op $op --backend cuda \
        "${vision[@]}" --blocks 16 --warmup 5 --iters 20 2>> "$V/bench.err" | grep '^{' > "$f"
      python3 -c "import json,sys; print(sys.argv[2], ' '.join('%.3f' % json.loads(l)['fwd_bwd_ms'] for l in open(sys.argv[1])))" \
        "$f" "vision fused=$fused r$round $op"
    done
  done
done
OUT=$V timeout 150 python3 .gpu_stage/bench/peers_attention.py vision 2> "$V/peers_vision.err" |
  grep '^{' > "$V/peers_vision.jsonl"
python3 -c "import json,sys; [print('vision peer', d['op'], d['N'], '%.3f' % d['fwdbwd_ms']) for d in map(json.loads, open(sys.argv[1])) if 'op' in d]" "$V/peers_vision.jsonl"

if command -v ncu > /dev/null; then
  step ncu
  for fused in 0 1; do
    MHLA_FUSED_MIX_BACKWARD=$fused timeout 120 ncu --clock-control none --metrics \
      gpu__time_duration.sum --csv "$bin" bench attention --op mhla --backend cuda \
      --shape 64,6,1024,64 --blocks 16 --warmup 0 --iters 1 > "$V/ncu_1024_f$fused.csv" 2> /dev/null
    python3 scripts/ncu_kernel_sums.py "$V/ncu_1024_f$fused.csv" 10
  done
fi

if [ -d data/fashion-mnist ]; then
  step probes
  s1024="configs/dit_s2_fmnist64.yaml --set attention.type"
  for fused in 0 1; do
    OUT=$V STEPS=60 MHLA_FUSED_MIX_BACKWARD=$fused scripts/gpu_throughput_probe.sh \
      "mhla1024_f$fused $s1024=mhla" | tee -a "$V/probes.jsonl"
  done
fi

step done
gzip -f "$V"/*.csv 2> /dev/null
tar czf "$OUT/mix_backward.tgz" -C "$OUT" mix_backward && rm -rf "$V"
