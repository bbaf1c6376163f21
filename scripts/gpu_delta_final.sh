#!/usr/bin/env bash
# Issue 4's table in one call: compute-sanitizer memcheck of the fused gated-DeltaNet test, then
# our gated DeltaNet (fused kernels) and fla's chunk_gated_delta_rule at the LM shapes, twice
# each, interleaved (ours, fla, ours, fla: fla's times moved by 40 % between two earlier calls),
# then our KDA (batched path). Carry .gpu_stage (gzipped binaries, triton_cache.tgz) and .whl;
# run after `source scripts/gpu_env.sh`. Results in $OUT/final.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/final; mkdir -p "$V"
bin=${MHLA_BIN:-build-gpu/mhla}; tests=${MHLA_TESTS_BIN:-build-gpu/tests/mhla_tests}
timeout 200 compute-sanitizer --tool memcheck "$tests" "delta rule: the fused*" > "$V/memcheck.log" 2>&1
echo "memcheck rc=$?: $(grep -E 'ERROR SUMMARY|All tests passed|failed' "$V/memcheck.log" | tr '\n' ' ')"
source scripts/gpu_fla_env.sh
shapes="--shape 16,8,2048,128 --shape 4,8,8192,128 --shape 1,8,32768,128"
for round in 1 2; do
  timeout 90 "$bin" bench attention --op gated_deltanet --causal --backend cuda $shapes \
    --warmup 3 --iters 10 2>> "$V/ours.err" | grep '^{' | sed "s/^{/{\"round\":$round,/" |
    tee -a "$V/ours_lm.jsonl"
  timeout 150 python3 scripts/fla_delta_peer.py 2>> "$V/peer.err" | grep '^{' |
    sed "s/^{/{\"round\":$round,/" | tee -a "$V/peers_lm.jsonl"
done
timeout 120 "$bin" bench attention --op kda --causal --backend cuda $shapes --warmup 2 --iters 5 \
  2>> "$V/ours.err" | grep '^{' | tee -a "$V/ours_lm.jsonl"
tar czf "$OUT/final.tgz" -C "$OUT" final
