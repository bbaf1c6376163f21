# Shared steps of the gated-delta device scripts (gpu_kda_final.sh, gpu_delta_ab.sh,
# gpu_delta_report.sh); source it, then call:
#   run_gpu_tests DIR LOG TIMEOUT TESTS-BIN FILTER...  the Catch2 cases, a summary and failures
#   memcheck_delta DIR BIN                              compute-sanitizer memcheck of KDA and
#                                                       gated DeltaNet forward+backward on
#                                                       small odd shapes
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
