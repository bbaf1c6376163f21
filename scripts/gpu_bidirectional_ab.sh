#!/usr/bin/env bash
# One device call comparing settings of the bidirectional linear-attention / MHLA kernels in one
# binary (environment switches), with the peers in the same call:
#   1. the bidirectional-family, state-mixing and op-harness [gpu] tests; memcheck and racecheck
#      of MHLA forward+backward under the last setting (partial tiles, 64-token blocks, D = 32,
#      the resident kernels at N = 256, 45-token blocks with several items per persistent CTA of
#      the pipelined passes, and nine 64-token blocks with several items per CTA of the sequence
#      forward; blocks of several tiles and of several chunks, many chunks per CTA of the
#      pipelined passes' chunk walk; up to three pairs per CTA of the resident kernels at N = 256,
#      so each tile set is filled twice; several pairs per CTA at N = 192, and at N = 64 and 128,
#      where the forward's four tile sets are refilled);
#   2. forward+backward at the vision shapes of ../shared/ANCHORS.md (B*N = 65,536, H = 6,
#      D = 64, M = 16), MHLA and linear attention, every setting, ROUNDS rounds;
#      ../shared/bench/peers_attention.py's vision peers once;
#      EXTRA_SHAPES, space-separated B,H,N,D/M (M blocks), are benched the same way, MHLA only
#      (e.g. the resident kernels' other sizes: "1024,6,64,64/4 340,6,192,64/12");
#   3. Nsight Compute durations per kernel of MHLA under every setting, at the shapes of
#      NCU_SHAPES (default "64,6,1024,64": B,H,N,D, optionally /M, else M = 16); NCU_CACHE=none
#      keeps L2 as the kernel before left it (Nsight's default flushes it before each kernel,
#      which hides reuse across kernels);
#   4. 60-step DiT-S/2 probes at 1,024 tokens with MHLA under every setting (when
#      data/fashion-mnist was carried and PROBES != 0).
# AB: the settings, space-separated; each a comma-separated list of VAR=value (or "-" for none),
# e.g. AB="MHLA_QUERY_PASS_CTAS=3 -". BIN=path in a setting runs another
# mhla binary for the bench and Nsight steps (a baseline build staged beside the new one, e.g.
# AB="BIN=/tmp/mhla_bin/mhla_base -"). Run from the repository root after
# `source scripts/gpu_env.sh` (carry .gpu_stage and, for the probes, data/fashion-mnist).
# Results in $OUT/bidirectional_ab.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/bidirectional_ab; mkdir -p "$V"
bin=${MHLA_BIN:-build-gpu/mhla}
tests=${MHLA_TESTS_BIN:-build-gpu/tests/mhla_tests}
settings=(${AB:--})
rounds=${ROUNDS:-2}
source scripts/gpu_delta_checks.sh
t0=$(date +%s); step() { echo "== $1 (t=$(( $(date +%s) - t0 ))s)"; }
# Runs a command under one setting's variables; an argument @mhla stands for the setting's mhla
# binary (its BIN, else the staged one).
with() {
  local s=$1; shift
  (
    [ "$s" = - ] || export $(echo "$s" | tr , ' ')
    args=()
    for a in "$@"; do [ "$a" = @mhla ] && args+=("${BIN:-$bin}") || args+=("$a"); done
    "${args[@]}"
  )
}

if [ "${SKIP_TESTS:-0}" != 1 ]; then
  step tests
  run_gpu_tests "$V" tests_bidirectional.txt 240 "$tests" "*bidirectional*"
  run_gpu_tests "$V" tests_mixing.txt 200 "$tests" "*block state mix*,*block pair products*,*fused block mix*"
  last=${settings[${#settings[@]}-1]}
  with "$last" run_gpu_tests "$V" tests_ops.txt 240 "$tests" "ops: every op and GPU backend*"
  for tool in memcheck racecheck; do
    for shape in "2,3,1200,64 --blocks 2" "8,6,1024,64 --blocks 16" "2,2,96,32 --blocks 4" \
      "3,2,256,64 --blocks 16" "8,8,720,64 --blocks 16" "24,8,576,64 --blocks 9" \
      "2,4,1000,32 --blocks 4" "16,8,1200,32 --blocks 2" "280,1,256,64 --blocks 16" \
      "300,1,192,64 --blocks 12" "1200,1,64,64 --blocks 4" "700,1,128,64 --blocks 8"; do
      f="$V/${tool}_$(echo "$shape" | tr -c 'A-Za-z0-9\n' _).txt"  # one file per shape
      with "$last" timeout 150 compute-sanitizer --tool $tool "$bin" bench attention --op mhla \
        --backend cuda --shape $shape --warmup 0 --iters 1 > "$f" 2>&1
      echo "$tool ($last, $shape): $(grep 'RACECHECK SUMMARY\|ERROR SUMMARY' "$f" | tail -1)"
    done
  done
fi

step bench
vision=(--shape 256,6,256,64 --shape 64,6,1024,64 --shape 16,6,4096,64 --shape 4,6,16384,64)
for round in $(seq 1 "$rounds"); do
  for i in "${!settings[@]}"; do
    for op in mhla linear; do
      f="$V/vision_s${i}_r${round}_$op.jsonl"
      with "${settings[$i]}" timeout 100 @mhla bench attention --op $op --backend cuda \
        "${vision[@]}" --blocks 16 --warmup 5 --iters 20 2>> "$V/bench.err" | grep '^{' > "$f"
      python3 -c "import json,sys; print(sys.argv[2], ' '.join('%.3f' % json.loads(l)['fwd_bwd_ms'] for l in open(sys.argv[1])))" \
        "$f" "vision [${settings[$i]}] r$round $op"
    done
    for shape in ${EXTRA_SHAPES:-}; do
      f="$V/extra_$(echo "$shape" | tr -c 'A-Za-z0-9\n' _)_s${i}_r${round}.jsonl"
      with "${settings[$i]}" timeout 100 @mhla bench attention --op mhla --backend cuda \
        --shape "${shape%/*}" --blocks "${shape#*/}" --warmup 5 --iters 20 2>> "$V/bench.err" |
        grep '^{' > "$f"
      python3 -c "import json,sys; print(sys.argv[2], ' '.join('%.4f' % json.loads(l)['fwd_bwd_ms'] for l in open(sys.argv[1])))" \
        "$f" "extra $shape [${settings[$i]}] r$round mhla"
    done
  done
done
OUT=$V timeout 150 python3 .gpu_stage/bench/peers_attention.py vision 2> "$V/peers_vision.err" |
  grep '^{' > "$V/peers_vision.jsonl"
python3 -c "import json,sys; [print('vision peer', d['op'], d['N'], '%.3f' % d['fwdbwd_ms']) for d in map(json.loads, open(sys.argv[1])) if 'op' in d]" "$V/peers_vision.jsonl"

if command -v ncu > /dev/null && [ "${SKIP_NCU:-0}" != 1 ]; then
  step ncu
  for shape in ${NCU_SHAPES:-64,6,1024,64}; do
    blocks=16
    case $shape in */*) blocks=${shape#*/}; shape=${shape%/*} ;; esac
    n=$(echo "$shape" | cut -d, -f3)
    for i in "${!settings[@]}"; do
      echo "ncu N=$n M=$blocks [${settings[$i]}]"
      with "${settings[$i]}" timeout 120 ncu --clock-control none --cache-control ${NCU_CACHE:-all} --metrics \
        gpu__time_duration.sum --csv @mhla bench attention --op mhla --backend cuda \
        --shape "$shape" --blocks $blocks --warmup 0 --iters 1 > "$V/ncu_${n}_s$i.csv" 2> /dev/null
      python3 scripts/ncu_kernel_sums.py "$V/ncu_${n}_s$i.csv" 10
    done
  done
fi

if [ -d data/fashion-mnist ] && [ "${PROBES:-1}" != 0 ]; then
  step probes
  s1024="configs/dit_s2_fmnist64.yaml --set attention.type"
  for i in "${!settings[@]}"; do
    OUT=$V STEPS=60 with "${settings[$i]}" scripts/gpu_throughput_probe.sh \
      "mhla1024_s$i $s1024=mhla" | tee -a "$V/probes.jsonl"
  done
fi

step done
gzip -f "$V"/*.csv 2> /dev/null
tar czf "$OUT/bidirectional_ab.tgz" -C "$OUT" bidirectional_ab && rm -rf "$V"
