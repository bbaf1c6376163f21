#!/usr/bin/env bash
# The gated-delta report call (session 12's, then named gpu_session12_final.sh): every [gpu]
# test (except the DeiT CUDA-graph case, which needs Fashion-MNIST: not carried), memcheck and
# racecheck of the gated-delta kernels in both walk modes, our gated DeltaNet and KDA
# forward+backward at the LM shapes (a previous binary, staged as mhla_prev.gz, and this one,
# before and after fla), fla's chunk_gated_delta_rule, chunk_kda and chunk_linear_attn, our
# causal linear and MHLA, the GPT table's KDA and gated-DeltaNet rows, and per-kernel times.
# Optional: BASE=1 also times the previous binary with the walks unsegmented
# (MHLA_DELTA_WALK_SEGMENTS=1, labels base*); SKIP_GPT=1 leaves out the GPT rows (then data/text
# need not be carried), SKIP_BREAKDOWN=1 the per-kernel times, SKIP_LINEAR=1 fla's linear
# attention (its Triton build outlasts the call's bound unless its cache is carried).
# Carry .gpu_stage (binaries, triton_cache.txz), .whl and data/text; run after
# `source scripts/gpu_env.sh`. Results in $OUT/final.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/final; mkdir -p "$V"
new=${MHLA_BIN:-build-gpu/mhla}; prev=/tmp/mhla_bin/mhla_prev
tests=${MHLA_TESTS_BIN:-build-gpu/tests/mhla_tests}
source scripts/gpu_delta_checks.sh
run_gpu_tests "$V" gpu_tests.log 260 "$tests" "[gpu]" "~train: CUDA-graph steps*"
memcheck_delta "$V" "$new"
walk_modes_delta "$V" "$new" "$tests"
[ -n "${BASE:-}" ] && MHLA_DELTA_WALK_SEGMENTS=1 bench_lm "$V" base1 "$prev" kda gated_deltanet
bench_lm "$V" prev1 "$prev" kda gated_deltanet linear mhla
bench_lm "$V" new1 "$new" kda gated_deltanet linear mhla
source scripts/gpu_fla_env.sh
summary="import json,sys; [print(d['op'], d['N'], '%.3f' % d['fwdbwd_ms']) for d in map(json.loads, sys.stdin)]"
timeout 150 python3 scripts/fla_delta_peer.py --kda 2> "$V/peer.err" | grep '^{' |
  tee "$V/peers_delta.jsonl" | python3 -c "$summary"
[ -z "${SKIP_LINEAR:-}" ] && OUT=$V timeout 100 python3 scripts/fla_linear_peer.py 2>> "$V/peer.err" | grep '^{' |
  tee "$V/peers_linear.jsonl" | python3 -c "$summary"
[ -n "${BASE:-}" ] && MHLA_DELTA_WALK_SEGMENTS=1 bench_lm "$V" base2 "$prev" kda gated_deltanet
bench_lm "$V" prev2 "$prev" kda gated_deltanet linear mhla
bench_lm "$V" new2 "$new" kda gated_deltanet linear mhla
[ -z "${SKIP_GPT:-}" ] && gpt_rows "$V" "$new" 150 kda gated_deltanet
[ -z "${SKIP_BREAKDOWN:-}" ] && kernel_times "$V" "$new" ncu_ 16,8,2048,128 12 kda gated_deltanet
gzip -f "$V"/*.csv "$V"/*.log 2>/dev/null
tar czf "$OUT/final.tgz" -C "$OUT" final
