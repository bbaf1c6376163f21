#!/usr/bin/env bash
# Session 21's closing device call (lean causal passes, packed prefix and dS sets, the sweeps):
#   1. every [gpu] test but the Fashion-MNIST training ones (their data does not fit the carry
#      beside fla's wheel), and GPT's CUDA-graph training test; memcheck of the small-shape causal
#      test; racecheck of causal MHLA on shapes that take the sweeps and the GEMM path;
#   2. forward+backward at the LM shapes: this binary two rounds, with the packed sets off
#      (MHLA_CAUSAL_PACKED_PREFIX=0) and with the session-20 passes (MHLA_CAUSAL_LEAN_PASSES=0),
#      fla's chunk_linear_attn in the same call; the vision shapes (bidirectional, unchanged
#      kernels but the state mix);
#   3. GPT training probes (60 steps, configs/gpt_austen_kjv.yaml): linear and MHLA, and MHLA
#      with the session-20 passes;
#   4. Nsight Compute durations per kernel of MHLA at T = 8,192.
# Run from the repository root after `source scripts/gpu_env.sh` (carry .gpu_stage, .whl and
# data/text). Results in $OUT/final21.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/final21; mkdir -p "$V"
bin=${MHLA_BIN:-build-gpu/mhla}
tests=${MHLA_TESTS_BIN:-build-gpu/tests/mhla_tests}
source scripts/gpu_delta_checks.sh
t0=$(date +%s); step() { echo "== $1 (t=$(( $(date +%s) - t0 ))s)"; }

step tests
run_gpu_tests "$V" tests_gpu.txt 300 "$tests" "[gpu]~[train]"
run_gpu_tests "$V" tests_gpt_graph.txt 120 "$tests" "gpt: CUDA-graph steps*"
timeout 150 compute-sanitizer --tool memcheck "$tests" \
  "attention: causal block-linear kernels on small odd shapes" > "$V/memcheck_causal.txt" 2>&1
echo "memcheck causal: $(grep 'ERROR SUMMARY' "$V/memcheck_causal.txt" | tail -1)"
for shape in 1,2,2100,64 2,3,150,128; do
  log="$V/racecheck_mhla_${shape//,/_}.txt"
  timeout 120 compute-sanitizer --tool racecheck "$bin" bench attention --op mhla --causal \
    --backend cuda --shape $shape --blocks 4 --warmup 0 --iters 1 > "$log" 2>&1
  echo "racecheck mhla $shape: $(grep 'RACECHECK SUMMARY' "$log" | tail -1)"
done

step bench
bench_lm "$V" lm_r1 "$bin" linear mhla
MHLA_CAUSAL_PACKED_PREFIX=0 bench_lm "$V" lm_unpacked "$bin" linear mhla
MHLA_CAUSAL_LEAN_PASSES=0 bench_lm "$V" lm_session20 "$bin" linear mhla
bench_lm "$V" lm_r2 "$bin" linear mhla
vision=(--shape 256,6,256,64 --shape 64,6,1024,64 --shape 16,6,4096,64 --shape 4,6,16384,64)
for op in mhla linear; do
  timeout 100 "$bin" bench attention --op $op --backend cuda "${vision[@]}" --blocks 16 \
    --warmup 5 --iters 20 2>> "$V/bench.err" | grep '^{' > "$V/vision_$op.jsonl"
  python3 -c "import json,sys; print(sys.argv[2], ' '.join('%.3f' % json.loads(l)['fwd_bwd_ms'] for l in open(sys.argv[1])))" \
    "$V/vision_$op.jsonl" "vision $op"
done
( source scripts/gpu_fla_env.sh
  OUT=$V timeout 200 python3 scripts/fla_linear_peer.py 2>&1 | grep '^{' | tee "$V/peers_lm.jsonl" )

step gpt
OUT=$V bash scripts/gpu_throughput_probe.sh \
  "gpt_linear configs/gpt_austen_kjv.yaml --set attention.type=linear" \
  "gpt_mhla configs/gpt_austen_kjv.yaml --set attention.type=mhla" | tee "$V/gpt_probes.jsonl"
MHLA_CAUSAL_LEAN_PASSES=0 OUT=$V bash scripts/gpu_throughput_probe.sh \
  "gpt_mhla_session20 configs/gpt_austen_kjv.yaml --set attention.type=mhla" \
  | tee -a "$V/gpt_probes.jsonl"

if command -v ncu > /dev/null; then
  step ncu
  kernel_times "$V" "$bin" "ncu_8192_" 4,8,8192,128 12 mhla
fi

step done
gzip -f "$V"/*.csv "$V"/*.log 2> /dev/null
tar czf "$OUT/final21.tgz" -C "$OUT" final21 && rm -rf "$V"
