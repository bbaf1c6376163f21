# Source on a GPU machine to run binaries staged by `scripts/stage_gpu.sh --binaries` instead of
# building there: they load that machine's torch (same version) and the staged libraries.
torch_lib=$(python3 -c 'import torch, os; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
stage=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.gpu_stage
export LD_LIBRARY_PATH="$torch_lib:$stage/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# Binaries staged gzipped (scripts/stage_gpu.sh) are unpacked outside the tree once per machine.
if ls "$stage"/bin/*.gz > /dev/null 2>&1; then
  mkdir -p /tmp/mhla_bin
  for packed in "$stage"/bin/*.gz; do
    gunzip -c "$packed" > "/tmp/mhla_bin/$(basename "$packed" .gz)"
    chmod +x "/tmp/mhla_bin/$(basename "$packed" .gz)"
  done
  export MHLA_BIN=/tmp/mhla_bin/mhla MHLA_TESTS_BIN=/tmp/mhla_bin/mhla_tests
else
  export MHLA_BIN="$stage/bin/mhla" MHLA_TESTS_BIN="$stage/bin/mhla_tests"
fi
export MHLA_DATA_DIR=${MHLA_DATA_DIR:-$(dirname "$stage")/data}
