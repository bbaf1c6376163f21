#!/usr/bin/env bash
# One device call that checks and times the causal block-linear kernels (the `cuda` backend of
# causal linear attention and causal MHLA, kernels/mhla/causal_block_linear):
#   1. every [gpu] test case (the op-test harness now runs the causal kernels too); memcheck of
#      the small-shape causal test;
#   2. `mhla bench attention --causal` for linear and MHLA (cuda, reference; MHLA also with
#      MHLA_CAUSAL_MIX_GEMM=1 and =0) and gated DeltaNet (cuda) at the LM shapes, then fla's chunk_linear_attn timed by the peer script's functions
#      (scripts/fla_linear_peer.py) in the same call;
#   3. 60-step GPT probes for linear and MHLA, reference against cuda;
#   4. the GPT table's linear, MHLA and hybrid rows trained again with the kernels.
# BENCH_BACKENDS (default "cuda reference"), SKIP_PEER=1, SKIP_REFERENCE=1 (no reference
# probes) and SKIP_ROWS=1 (no table rows) shorten a repeat call. Run from the repository root after `source scripts/gpu_env.sh` (binaries from
# `scripts/stage_gpu.sh --binaries`; carry .gpu_stage, data/text and .whl). Results in
# $OUT/causal.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/causal; mkdir -p "$V"
bin=${MHLA_BIN:-build-gpu/mhla}
tests=${MHLA_TESTS_BIN:-build-gpu/tests/mhla_tests}
t0=$(date +%s); step() { echo "== $1 (t=$(( $(date +%s) - t0 ))s)"; }

step tests
timeout 200 "$tests" "${TEST_FILTER:-[gpu]}" > "$V/gpu_tests.txt" 2>&1; echo "gpu tests rc=$?"
tail -3 "$V/gpu_tests.txt"; grep -B5 -A25 FAILED "$V/gpu_tests.txt" | head -120
# The prefix mixing by GEMM at every length, and by the kernels' sweep at every length (defaults:
# GEMMs inside the trained length, the sweep past it): the causal tests under each.
for mode in 1 0; do
  MHLA_CAUSAL_MIX_GEMM=$mode timeout 120 "$tests" "*causal block-linear*" > "$V/tests_mix_gemm_$mode.txt" 2>&1
  echo "causal tests with MHLA_CAUSAL_MIX_GEMM=$mode rc=$?: $(tail -2 "$V/tests_mix_gemm_$mode.txt" | head -1)"
done
if command -v compute-sanitizer > /dev/null; then
  timeout 120 compute-sanitizer --tool memcheck "$tests" "attention: causal block-linear kernels on small odd shapes" \
    > "$V/memcheck.txt" 2>&1
  echo "memcheck causal: $(grep 'ERROR SUMMARY' "$V/memcheck.txt" | tail -1)"
  grep -m5 -A8 "Invalid\|out of bounds" "$V/memcheck.txt" | head -40
fi

step bench
shapes=(--shape 16,8,2048,128 --shape 4,8,8192,128 --shape 1,8,32768,128)
for op in linear mhla; do
  timeout 120 "$bin" bench attention --op $op --causal --backend ${BENCH_BACKENDS:-cuda reference} "${shapes[@]}" \
    --blocks 16 --warmup 3 --iters 10 | grep '^{' | tee -a "$V/ours_lm.jsonl"
done
for mode in 1 0; do  # the A/B of the prefix mixing (see above)
  MHLA_CAUSAL_MIX_GEMM=$mode timeout 120 "$bin" bench attention --op mhla --causal --backend cuda \
    "${shapes[@]}" --blocks 16 --warmup 3 --iters 10 | grep '^{' |
    sed "s/^{/{\"mix_gemm\": $mode, /" | tee -a "$V/mix_gemm_ab.jsonl"
done
timeout 60 "$bin" bench attention --op gated_deltanet --causal --backend cuda "${shapes[@]}" \
  --warmup 2 --iters 5 | grep '^{' | tee -a "$V/ours_lm.jsonl"
source scripts/gpu_fla_env.sh
[ "${SKIP_PEER:-0}" = 1 ] || OUT=$V timeout 200 python3 scripts/fla_linear_peer.py 2>&1 | grep '^{' | tee "$V/peers_lm.jsonl"
tar czf "$V/triton_cache.tgz" -C "$TRITON_CACHE_DIR" . 2>/dev/null
python3 scripts/lm_attention_table.py "$V/ours_lm.jsonl" "$V/peers_lm.jsonl" > "$V/attention_lm.md"

step probes
G=configs/gpt_austen_kjv.yaml
probe() {  # LABEL CONFIG ARGS...
  OUT="$V/probes" MHLA_BIN="$bin" STEPS=60 timeout 60 scripts/gpu_throughput_probe.sh "$*" |
    tee -a "$V/probes.jsonl"
}
if [ "${SKIP_REFERENCE:-0}" != 1 ]; then
  probe gpt_linear_reference $G --set attention.type=linear --set attention.backend=reference
  probe gpt_mhla_reference $G --set attention.type=mhla --set attention.backend=reference
fi
probe gpt_linear_cuda $G --set attention.type=linear
probe gpt_mhla_cuda $G --set attention.type=mhla
probe gpt_softmax $G

[ "${SKIP_ROWS:-0}" = 1 ] && { tar czf "$OUT/causal.tgz" -C "$OUT" causal; step done; exit 0; }
step gpt_table_rows
for row in "linear --set attention.type=linear" "mhla --set attention.type=mhla" \
           "hybrid --set attention.type=mhla --set attention.pattern=mhla,mhla,mhla,softmax"; do
  read -r name rest <<< "$row"
  # shellcheck disable=SC2086
  timeout 90 "$bin" train $G $rest --set run.name=gpt_$name > "$V/gpt_$name.log" 2>&1
  echo "gpt $name rc=$?: $(grep -E 'done:' "$V/gpt_$name.log")"
  cp runs/gpt_$name/metrics.jsonl "$V/gpt_${name}_metrics.jsonl" 2>/dev/null
done
tar czf "$OUT/causal.tgz" -C "$OUT" causal
step done
