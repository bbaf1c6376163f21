# Shared steps of the gated-delta device scripts (gpu_kda_final.sh, gpu_delta_ab.sh,
# gpu_delta_report.sh); source it, then call:
#   run_gpu_tests DIR LOG TIMEOUT TESTS-BIN FILTER...  the Catch2 cases, a summary and failures
#   memcheck_delta DIR BIN                              compute-sanitizer memcheck of KDA and
#                                                       gated DeltaNet forward+backward on
#                                                       small odd shapes
#   bench_lm DIR LABEL BIN OPS...                       forward+backward of each op at the LM
#                                                       shapes into DIR/LABEL_OP.jsonl, a summary
#                                                       line per op
#   gpt_rows DIR BIN LIMIT OPS...                       the GPT table's rows for those attention
#                                                       types (configs/gpt_austen_kjv.yaml)
#   kernel_times DIR BIN PREFIX SHAPE TOP OPS...         Nsight Compute durations per kernel of
#                                                       one forward+backward at SHAPE (with
#                                                       --blocks 16), summed by kernel
#   walk_modes_delta DIR BIN TESTS-BIN                  the fused tests, racecheck and memcheck
#                                                       with the backward walk's paired buffering
#                                                       forced (small shapes take the other)
run_gpu_tests() {
  local dir=$1 log=$2 limit=$3 tests=$4; shift 4
  timeout "$limit" "$tests" "$@" > "$dir/$log" 2>&1
  echo "tests rc=$?"; tail -3 "$dir/$log"
  grep -B3 -A12 FAILED "$dir/$log" | head -60
}

memcheck_delta() {
  local dir=$1 bin=$2 s op log
  for s in 1,2,200,64 2,1,130,128; do
    for op in kda gated_deltanet; do
      log="$dir/memcheck_${op}_${s//,/_}.log"
      timeout 120 compute-sanitizer --tool memcheck "$bin" bench attention --op $op --causal \
        --backend cuda --shape $s --warmup 0 --iters 1 > "$log" 2>&1
      echo "memcheck $op $s rc=$?: $(grep -E 'ERROR SUMMARY' "$log")"
    done
  done
}

walk_modes_delta() {
  local dir=$1 bin=$2 tests=$3 tool buffers op log
  # The backward walk's paired buffering is taken only for grids larger than the GPU; the tests'
  # shapes are small, so run them (and memcheck, racecheck) with it forced as well.
  MHLA_DELTA_WALK_BUFFERS=1 run_gpu_tests "$dir" tests_paired.log 200 "$tests" \
    "delta rule: the fused*"
  for tool in racecheck memcheck; do
    for buffers in 1 2; do
      [ $tool = memcheck ] && [ $buffers = 2 ] && continue  # memcheck_delta ran it
      for op in gated_deltanet kda; do
        log="$dir/${tool}_${op}_walk$buffers.log"
        MHLA_DELTA_WALK_BUFFERS=$buffers timeout 150 compute-sanitizer --tool $tool "$bin" \
          bench attention --op $op --causal --backend cuda --shape 1,2,200,64 --warmup 0 \
          --iters 1 > "$log" 2>&1
        echo "$tool $op buffers=$buffers rc=$?: $(grep -E 'SUMMARY' "$log" | tr '\n' ' ')"
      done
    done
  done
}

LM_SHAPES="--shape 16,8,2048,128 --shape 4,8,8192,128 --shape 1,8,32768,128"

bench_lm() {
  local dir=$1 label=$2 bin=$3 op; shift 3
  for op in "$@"; do
    timeout 100 "$bin" bench attention --op $op --causal --backend cuda $LM_SHAPES --blocks 16 \
      --warmup 3 --iters 10 2>> "$dir/bench.err" | grep '^{' > "$dir/${label}_$op.jsonl"
    python3 -c "import json,sys; print(sys.argv[2], ' '.join('%.3f' % json.loads(l)['fwd_bwd_ms'] for l in open(sys.argv[1])))" \
      "$dir/${label}_$op.jsonl" "$label $op"
  done
}

gpt_rows() {
  local dir=$1 bin=$2 limit=$3 op; shift 3
  for op in "$@"; do
    timeout "$limit" "$bin" train configs/gpt_austen_kjv.yaml --set attention.type=$op \
      --set run.name=gpt_$op > "$dir/gpt_$op.log" 2>&1
    echo "gpt $op rc=$?: $(grep -E 'done:' "$dir/gpt_$op.log")"
    tail -3 "$dir/gpt_$op.log"
    cp "runs/gpt_$op/metrics.jsonl" "$dir/gpt_${op}_metrics.jsonl" 2>/dev/null
  done
}

kernel_times() {
  local dir=$1 bin=$2 prefix=$3 shape=$4 top=$5 op; shift 5
  for op in "$@"; do
    timeout 120 ncu --clock-control none --metrics gpu__time_duration.sum --csv "$bin" bench \
      attention --op $op --causal --backend cuda --shape $shape --blocks 16 --warmup 0 \
      --iters 1 > "$dir/${prefix}$op.csv" 2> /dev/null
    python3 scripts/ncu_kernel_sums.py "$dir/${prefix}$op.csv" "$top"
  done
}
