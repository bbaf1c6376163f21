#!/usr/bin/env bash
# One device call that checks the gated DeltaNet chunk-gradient pass (kernels/gated_delta/
# chunk_gradients.cu) where its persistent CTAs take several chunks each:
#   1. the fused-kernel tests ("delta rule: the fused*": against the float64 reference, with
#      several chunks per CTA at D = 64 and 128 and DiT-S/2's shape; segments bit for bit; the
#      CUDA-graph replay);
#   2. forward+backward ms at the LM shapes and DiT-S/2's attention shape with the persistent
#      CTAs (default) and with one chunk per CTA (MHLA_DELTA_GRADS_PERSISTENT=0);
#   3. a 60-step DiT-S/2 probe with gated DeltaNet (it diverged before the session-17 fix).
# Run from the repository root after `source scripts/gpu_env.sh` (binaries from
# `scripts/stage_gpu.sh --binaries`; carry .gpu_stage and data/fashion-mnist). Results in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bin=${MHLA_BIN:-build-gpu/mhla}
tests=${MHLA_TESTS_BIN:-build-gpu/tests/mhla_tests}
t0=$(date +%s)
timeout 150 "$tests" "delta rule: the fused*" > "$OUT/fused_tests.txt" 2>&1
echo "== fused tests rc=$? t=$(( $(date +%s) - t0 ))s"; tail -2 "$OUT/fused_tests.txt"
grep -A6 "FAILED" "$OUT/fused_tests.txt" | head -40
for persistent in 1 0; do
  MHLA_DELTA_GRADS_PERSISTENT=$persistent timeout 60 "$bin" bench attention --op gated_deltanet \
    --causal --backend cuda --shape 16,8,2048,128 --shape 4,8,8192,128 --shape 1,8,32768,128 \
    --shape 256,6,256,64 --warmup 3 --iters 10 2> /dev/null | grep '^{' > "$OUT/bench_gdn_p$persistent.jsonl"
  python3 -c "import json,sys; print(sys.argv[2], ' '.join('%.3f' % json.loads(l)['fwd_bwd_ms'] for l in open(sys.argv[1])))" \
    "$OUT/bench_gdn_p$persistent.jsonl" "gated_deltanet persistent=$persistent"
done
OUT=/tmp/probe_logs STEPS=60 timeout 150 scripts/gpu_throughput_probe.sh \
  "dit_gated_deltanet configs/dit_s2_fmnist.yaml --set attention.type=gated_deltanet" |
  tee "$OUT/dit_probe.jsonl"
grep -h "loss" /tmp/probe_logs/probe_dit_gated_deltanet.log | tail -3
echo "t=$(( $(date +%s) - t0 ))s"
