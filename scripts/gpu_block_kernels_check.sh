#!/usr/bin/env bash
# One device call after a change to the block-linear kernels (bidirectional and causal linear
# attention / MHLA): every [gpu] test, memcheck of the small causal and pair-products cases, the
# per-kernel breakdown of one causal and one vision case, the vision table beside the peers
# (scripts/gpu_attention_bench.sh vision), and the causal LM shapes beside fla's
# chunk_linear_attn (scripts/fla_linear_peer.py; carry .whl and, to skip Triton's compile,
# .gpu_stage/triton_cache.tgz). Binaries from `scripts/stage_gpu.sh --binaries`; run after
# `source scripts/gpu_env.sh`. Results in $OUT/blocks.tgz. SKIP_VISION=1 / SKIP_PEER=1 shorten it;
# MIX_AB=1 adds the causal MHLA bench with MHLA_CAUSAL_MIX_GEMM=1 and =0.
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/blocks; mkdir -p "$V"
bin=${MHLA_BIN:-build-gpu/mhla}
tests=${MHLA_TESTS_BIN:-build-gpu/tests/mhla_tests}
t0=$(date +%s); step() { echo "== $1 (t=$(( $(date +%s) - t0 ))s)"; }

step tests
timeout 200 "$tests" "${TEST_FILTER:-[gpu]}" > "$V/gpu_tests.txt" 2>&1; echo "gpu tests rc=$?"
tail -3 "$V/gpu_tests.txt"; grep -B5 -A25 FAILED "$V/gpu_tests.txt" | head -100
for case in "attention: causal block-linear kernels on small odd shapes" \
            "attention: block pair products (mixing gradient) against float64"; do
  timeout 150 compute-sanitizer --tool memcheck "$tests" "$case" >> "$V/memcheck.txt" 2>&1
  echo "memcheck $case: $(grep 'ERROR SUMMARY' "$V/memcheck.txt" | tail -1)"
done

step breakdown
OUT=$V scripts/gpu_kernel_breakdown.sh mhla2048 --op mhla --causal --backend cuda --shape 16,8,2048,128 --blocks 16 2>&1 | tail -12
OUT=$V scripts/gpu_kernel_breakdown.sh vmhla1024 --op mhla --backend cuda --shape 64,6,1024,64 --blocks 16 2>&1 | tail -12
OUT=$V scripts/gpu_kernel_breakdown.sh vlin1024 --op linear --backend cuda --shape 64,6,1024,64 2>&1 | tail -8

step causal_bench
shapes=(--shape 16,8,2048,128 --shape 4,8,8192,128 --shape 1,8,32768,128)
for op in linear mhla; do
  timeout 120 "$bin" bench attention --op $op --causal --backend cuda "${shapes[@]}" \
    --blocks 16 --warmup 3 --iters 10 | grep '^{' | tee -a "$V/ours_lm.jsonl"
done
if [ "${MIX_AB:-0}" = 1 ]; then  # the causal prefix mixing as matrix products / as sweeps, everywhere
  for mode in 1 0; do
    MHLA_CAUSAL_MIX_GEMM=$mode timeout 120 "$bin" bench attention --op mhla --causal --backend cuda \
      "${shapes[@]}" --blocks 16 --warmup 3 --iters 10 | grep '^{' |
      sed "s/^{/{\"mix_gemm\": $mode, /" | tee -a "$V/mix_gemm_ab.jsonl"
  done
fi
if [ "${SKIP_PEER:-0}" != 1 ]; then
  source scripts/gpu_fla_env.sh
  OUT=$V timeout 200 python3 scripts/fla_linear_peer.py 2>&1 | grep '^{' | tee "$V/peers_lm.jsonl"
  python3 scripts/lm_attention_table.py "$V/ours_lm.jsonl" "$V/peers_lm.jsonl" > "$V/attention_lm.md"
fi

if [ "${SKIP_VISION:-0}" != 1 ]; then
  step vision_bench
  OUT=$V/vision timeout 300 scripts/gpu_attention_bench.sh vision > "$V/vision.log" 2>&1
  echo "vision rc=$?"; cat "$V/vision/attention_vision.md" 2>/dev/null | head -12
fi
tar czf "$OUT/blocks.tgz" -C "$OUT" blocks
step done
