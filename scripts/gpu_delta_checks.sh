# Shared steps of the gated-delta device scripts (gpu_kda_final.sh, gpu_delta_ab.sh,
# gpu_session12_final.sh); source it, then call:
#   run_gpu_tests DIR LOG TIMEOUT TESTS-BIN FILTER...  the Catch2 cases, a summary and failures
#   memcheck_delta DIR BIN                              compute-sanitizer memcheck of KDA and
#                                                       gated DeltaNet forward+backward on
#                                                       small odd shapes
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
