#!/usr/bin/env bash
# The gated-delta report call (session 12's, then named gpu_session12_final.sh): every [gpu]
# test (except the DeiT CUDA-graph case, which needs Fashion-MNIST: not carried), memcheck and
# racecheck of the gated-delta kernels in both walk modes, our gated DeltaNet and KDA
# forward+backward at the LM shapes (a previous binary, staged as mhla_prev.gz, and this one,
# before and after fla), fla's chunk_gated_delta_rule, chunk_kda and chunk_linear_attn, our
# causal linear and MHLA, the GPT table's KDA and gated-DeltaNet rows, and per-kernel times.
# Carry .gpu_stage (binaries, triton_cache.txz), .whl and data/text; run after
# `source scripts/gpu_env.sh`. Results in $OUT/final.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/final; mkdir -p "$V"
new=${MHLA_BIN:-build-gpu/mhla}; prev=/tmp/mhla_bin/mhla_prev
tests=${MHLA_TESTS_BIN:-build-gpu/tests/mhla_tests}
shapes="--shape 16,8,2048,128 --shape 4,8,8192,128 --shape 1,8,32768,128"
source scripts/gpu_delta_checks.sh
run_gpu_tests "$V" gpu_tests.log 260 "$tests" "[gpu]" "~train: CUDA-graph steps*"
memcheck_delta "$V" "$new"
walk_modes_delta "$V" "$new" "$tests"
bench() {  # bench LABEL BINARY OPS...
  local label=$1 bin=$2; shift 2
  for op in "$@"; do
    timeout 100 "$bin" bench attention --op $op --causal --backend cuda $shapes --blocks 16 \
      --warmup 3 --iters 10 2>> "$V/bench.err" | grep '^{' > "$V/${label}_$op.jsonl"
    python3 -c "import json,sys; print('$label $op', ' '.join('%.3f' % json.loads(l)['fwd_bwd_ms'] for l in open(sys.argv[1])))" "$V/${label}_$op.jsonl"
  done
}
bench prev1 "$prev" kda gated_deltanet linear mhla
bench new1 "$new" kda gated_deltanet linear mhla
source scripts/gpu_fla_env.sh
summary="import json,sys; [print(d['op'], d['N'], '%.3f' % d['fwdbwd_ms']) for d in map(json.loads, sys.stdin)]"
timeout 150 python3 scripts/fla_delta_peer.py --kda 2> "$V/peer.err" | grep '^{' |
  tee "$V/peers_delta.jsonl" | python3 -c "$summary"
OUT=$V timeout 100 python3 scripts/fla_linear_peer.py 2>> "$V/peer.err" | grep '^{' |
  tee "$V/peers_linear.jsonl" | python3 -c "$summary"
bench prev2 "$prev" kda gated_deltanet linear mhla
bench new2 "$new" kda gated_deltanet linear mhla
for op in kda gated_deltanet; do
  timeout 150 "$new" train configs/gpt_austen_kjv.yaml --set attention.type=$op \
    --set run.name=gpt_$op > "$V/gpt_$op.log" 2>&1
  echo "gpt $op rc=$?: $(grep -E 'done:' "$V/gpt_$op.log")"
  tail -2 "$V/gpt_$op.log"
  cp "runs/gpt_$op/metrics.jsonl" "$V/gpt_${op}_metrics.jsonl" 2>/dev/null
done
for op in kda gated_deltanet; do
  timeout 100 ncu --clock-control none --metrics gpu__time_duration.sum --csv "$new" bench \
    attention --op $op --causal --backend cuda --shape 16,8,2048,128 --warmup 0 --iters 1 \
    > "$V/ncu_$op.csv" 2> /dev/null
  python3 scripts/ncu_kernel_sums.py "$V/ncu_$op.csv" 12
done
gzip -f "$V"/*.csv "$V"/*.log 2>/dev/null
tar czf "$OUT/final.tgz" -C "$OUT" final
