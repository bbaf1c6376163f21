#!/usr/bin/env bash
# One device call for the pipelined state walks (gated_delta_walk_segments): the fused-kernel
# tests (the segments test among them) and the sanitizers with the walks cut into segments, then
# forward+backward at the LM shapes with the segment count forced to each of SEGMENTS (default:
# "1 auto 4 16"; auto = the kernels' own choice) for gated DeltaNet and KDA, alternated over two
# rounds, and fla's ops (Triton cache carried or compiled here and packed into $OUT) between the
# rounds. Optional: SKIP_TESTS=1, SKIP_PEER=1. Carry .gpu_stage and .whl; run after
# `source scripts/gpu_env.sh`. Results in $OUT/segments.tgz (and $OUT/triton_cache.txz when fla
# compiled here).
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/segments; mkdir -p "$V"
bin=${MHLA_BIN:-build-gpu/mhla}
tests=${MHLA_TESTS_BIN:-build-gpu/tests/mhla_tests}
source scripts/gpu_delta_checks.sh
if [ -z "${SKIP_TESTS:-}" ]; then
  run_gpu_tests "$V" tests.log 300 "$tests" \
    "delta rule: the fused*,delta rule: the chunk-recurrence*,ops: every op and GPU backend*"
  walk_modes_delta "$V" "$bin" "$tests"
  for tool in memcheck racecheck; do
    for op in gated_deltanet kda; do
      log="$V/${tool}_${op}_segments.log"
      MHLA_DELTA_WALK_SEGMENTS=3 timeout 150 compute-sanitizer --tool $tool "$bin" bench \
        attention --op $op --causal --backend cuda --shape 1,2,300,64 --warmup 0 --iters 1 \
        > "$log" 2>&1
      echo "$tool $op segments=3 rc=$?: $(grep -E 'SUMMARY' "$log" | tr '\n' ' ')"
    done
  done
fi
# A setting is N (segments forced) or auto (the kernels' choice), optionally with :eW for the end
# segments' weight (MHLA_DELTA_SEGMENT_END_WEIGHT, 1-4).
round() {
  local r=$1 s count ends
  for s in ${SEGMENTS:-1 auto 4 16}; do
    count=${s%%:*}; ends=""; [ "$s" != "$count" ] && ends=${s#*:e}
    (
      if [ "$count" = auto ]; then unset MHLA_DELTA_WALK_SEGMENTS
      else export MHLA_DELTA_WALK_SEGMENTS=$count; fi
      if [ -n "$ends" ]; then export MHLA_DELTA_SEGMENT_END_WEIGHT=$ends
      else unset MHLA_DELTA_SEGMENT_END_WEIGHT; fi
      bench_lm "$V" "r${r}_seg${s/:/_}" "$bin" gated_deltanet kda
    )
  done
}
round 1
if [ -z "${SKIP_PEER:-}" ]; then
  source scripts/gpu_fla_env.sh
  had_cache=$(ls .gpu_stage/triton_cache.t* 2> /dev/null | wc -l)
  timeout 300 python3 scripts/fla_delta_peer.py --kda 2> "$V/peer.err" | grep '^{' |
    tee "$V/peers_delta.jsonl" |
    python3 -c "import json,sys; [print(d['op'], d['N'], '%.3f' % d['fwdbwd_ms']) for d in map(json.loads, sys.stdin)]"
  [ "$had_cache" = 0 ] && tar cJf "$OUT/triton_cache.txz" -C "$TRITON_CACHE_DIR" .
fi
round 2
tar czf "$OUT/segments.tgz" -C "$OUT" segments
