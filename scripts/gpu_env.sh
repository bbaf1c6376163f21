# Source on a GPU machine to run binaries staged by `scripts/stage_gpu.sh --binaries` instead of
# building there: they load that machine's torch (same version) and the staged libraries.
torch_lib=$(python3 -c 'import torch, os; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
stage=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.gpu_stage
export LD_LIBRARY_PATH="$torch_lib:$stage/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export MHLA_BIN="$stage/bin/mhla" MHLA_TESTS_BIN="$stage/bin/mhla_tests"
export MHLA_DATA_DIR=${MHLA_DATA_DIR:-$(dirname "$stage")/data}
