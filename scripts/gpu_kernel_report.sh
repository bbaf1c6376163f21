#!/usr/bin/env bash
# The block-linear kernels' numbers for issues 3, 5 and 6 in one device call, every ratio timed
# side by side: every [gpu] test (and the causal ones with the prefix mixing forced to each
# path); the causal LM shapes (linear, MHLA; MHLA also with MHLA_CAUSAL_MIX_GEMM=1 and =0) beside
# fla's chunk_linear_attn; the vision table beside the peers; 60-step GPT probes (linear, MHLA,
# softmax); 40-step DiT probes at 1,024 tokens (softmax, MHLA). Carry .gpu_stage (gzipped
# binaries from `scripts/stage_gpu.sh --binaries`, triton_cache.tgz), .whl, data/text and
# data/fashion-mnist; run after `source scripts/gpu_env.sh`. Results in $OUT/report.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/report; mkdir -p "$V"
bin=${MHLA_BIN:-build-gpu/mhla}
tests=${MHLA_TESTS_BIN:-build-gpu/tests/mhla_tests}
t0=$(date +%s); step() { echo "== $1 (t=$(( $(date +%s) - t0 ))s)"; }

step tests
timeout 150 "$tests" "[gpu]" > "$V/gpu_tests.txt" 2>&1; echo "gpu tests rc=$?"
tail -3 "$V/gpu_tests.txt"; grep -B5 -A25 FAILED "$V/gpu_tests.txt" | head -80
for mode in 1 0; do
  MHLA_CAUSAL_MIX_GEMM=$mode timeout 90 "$tests" "*causal block-linear*" > "$V/tests_mix_gemm_$mode.txt" 2>&1
  echo "causal tests with MHLA_CAUSAL_MIX_GEMM=$mode rc=$?: $(tail -2 "$V/tests_mix_gemm_$mode.txt" | head -1)"
done

step lm_bench
shapes=(--shape 16,8,2048,128 --shape 4,8,8192,128 --shape 1,8,32768,128)
for op in linear mhla; do
  timeout 90 "$bin" bench attention --op $op --causal --backend cuda "${shapes[@]}" \
    --blocks 16 --warmup 3 --iters 10 | grep '^{' | tee -a "$V/ours_lm.jsonl"
done
for mode in 1 0; do
  MHLA_CAUSAL_MIX_GEMM=$mode timeout 90 "$bin" bench attention --op mhla --causal --backend cuda \
    "${shapes[@]}" --blocks 16 --warmup 3 --iters 10 | grep '^{' |
    sed "s/^{/{\"mix_gemm\": $mode, /" | tee -a "$V/mix_gemm_ab.jsonl"
done
source scripts/gpu_fla_env.sh
OUT=$V timeout 150 python3 scripts/fla_linear_peer.py 2>&1 | grep '^{' | tee "$V/peers_lm.jsonl"
python3 scripts/lm_attention_table.py "$V/ours_lm.jsonl" "$V/peers_lm.jsonl" > "$V/attention_lm.md"
cat "$V/attention_lm.md" | head -12

step vision_bench
OUT=$V/vision timeout 150 scripts/gpu_attention_bench.sh vision > "$V/vision.log" 2>&1
echo "vision rc=$?"; head -9 "$V/vision/attention_vision.md" 2>/dev/null | tail -6

step probes
probe() {  # LABEL CONFIG ARGS...
  OUT="$V/probes" MHLA_BIN="$bin" STEPS=${STEPS:-60} timeout 90 scripts/gpu_throughput_probe.sh "$*" |
    tee -a "$V/probes.jsonl"
}
G=configs/gpt_austen_kjv.yaml
probe gpt_linear $G --set attention.type=linear
probe gpt_mhla $G --set attention.type=mhla
probe gpt_softmax $G
STEPS=40 probe dit64_softmax configs/dit_s2_fmnist64.yaml --set attention.type=softmax
STEPS=40 probe dit64_mhla configs/dit_s2_fmnist64.yaml --set attention.type=mhla
tar czf "$OUT/report.tgz" -C "$OUT" report
step done
