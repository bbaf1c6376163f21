#!/usr/bin/env bash
# One device call on MHLA's one-kernel forward (kernels/mhla/sequence_state_forward.cu) at
# shapes of 64-token blocks: forward+backward per setting, ROUNDS rounds, then Nsight durations
# per kernel under each setting, then (unless SKIP_TESTS=1) the bidirectional-family tests and
# memcheck / racecheck of the last setting on a shape with several (batch, head) items per CTA.
# SETTINGS: space-separated, each a comma-separated VAR=value list ("-" for none).
# SHAPES: space-separated "B,H,N,D,M". Run after `source scripts/gpu_env.sh`, carrying
# .gpu_stage; results in $OUT/sequence_depth.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/sequence_depth; mkdir -p "$V"
bin=${MHLA_BIN:-build-gpu/mhla}; tests=${MHLA_TESTS_BIN:-build-gpu/tests/mhla_tests}
settings=(${SETTINGS:-"MHLA_SEQUENCE_FORWARD=0" -})
shapes=(${SHAPES:-128,6,512,64,8 64,6,1024,64,16})
with() { local s=$1; shift; ( [ "$s" = - ] || export $(echo "$s" | tr , ' '); "$@" ); }
bench() {  # setting shape
  local sh=${2%,*} m=${2##*,}
  with "$1" timeout 60 "$bin" bench attention --op mhla --backend cuda --shape "$sh" --blocks "$m" \
    --warmup 5 --iters 20 2>> "$V/bench.err" | grep '^{'
}
for round in $(seq 1 "${ROUNDS:-2}"); do
  for shape in "${shapes[@]}"; do
    for s in "${settings[@]}"; do
      line=$(bench "$s" "$shape"); echo "$line" >> "$V/bench.jsonl"
      python3 -c "import json,sys; d=json.loads(sys.argv[1]); print('r$round', sys.argv[2], sys.argv[3], 'fwd %.4f fwd+bwd %.4f ms (%.1f %% of copy)' % (d['fwd_ms'], d['fwd_bwd_ms'], 100*d['fwd_bwd_bandwidth_share']))" "$line" "$shape" "[$s]"
    done
  done
done
if command -v ncu > /dev/null; then
  for shape in "${shapes[@]}"; do
    for i in "${!settings[@]}"; do
      f="$V/ncu_$(echo "$shape" | tr , _)_s$i.csv"
      with "${settings[$i]}" timeout 120 ncu --clock-control none --metrics gpu__time_duration.sum \
        --csv "$bin" bench attention --op mhla --backend cuda --shape "${shape%,*}" --blocks "${shape##*,}" \
        --warmup 0 --iters 1 > "$f" 2> /dev/null
      echo "ncu $shape [${settings[$i]}]"; python3 scripts/ncu_kernel_sums.py "$f" 8
    done
  done
fi
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 240 "$tests" "*bidirectional*" > "$V/tests_bidirectional.txt" 2>&1; tail -n 2 "$V/tests_bidirectional.txt"
  last=${settings[${#settings[@]}-1]}
  for tool in memcheck racecheck; do
    for shape in ${SAN_SHAPES:-40,8,512,64,8 24,8,576,64,9}; do
      f="$V/${tool}_$(echo "$shape" | tr , _).txt"
      with "$last" timeout 150 compute-sanitizer --tool $tool "$bin" bench attention --op mhla \
        --backend cuda --shape "${shape%,*}" --blocks "${shape##*,}" --warmup 0 --iters 1 > "$f" 2>&1
      echo "$tool ($last, $shape): $(grep 'RACECHECK SUMMARY\|ERROR SUMMARY' "$f" | tail -1)"
    done
  done
fi
gzip -f "$V"/*.csv 2> /dev/null
tar czf "$OUT/sequence_depth.tgz" -C "$OUT" sequence_depth && rm -rf "$V"
