# Source on a GPU machine to run binaries staged by `scripts/stage_gpu.sh --binaries` instead of
# building there: they load that machine's torch (same version) and the staged libraries.
torch_lib=$(python3 -c 'import torch, os; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
stage=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.gpu_stage
# cuBLASLt (the GELU products) from the copy that machine's torch loads: pip's nvidia/cu13/lib.
nvidia_lib=$(dirname "$(dirname "$torch_lib")")/nvidia/cu13/lib
[ -d "$nvidia_lib" ] && torch_lib="$torch_lib:$nvidia_lib"
export LD_LIBRARY_PATH="$torch_lib:$stage/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# Binaries staged compressed (scripts/stage_gpu.sh: .xz, older stages .gz) are unpacked outside
# the tree once per machine (python's lzma where the machine has no xz).
if [ -n "$(ls "$stage"/bin/*.xz "$stage"/bin/*.gz 2> /dev/null)" ]; then
  mkdir -p /tmp/mhla_bin
  for packed in "$stage"/bin/*.xz "$stage"/bin/*.gz; do
    [ -f "$packed" ] || continue
    name=$(basename "${packed%.*}")
    case "$packed" in
      *.xz) if command -v xz > /dev/null; then xz -dc "$packed" > "/tmp/mhla_bin/$name"
            else python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$packed" "/tmp/mhla_bin/$name"; fi ;;
      *) gunzip -c "$packed" > "/tmp/mhla_bin/$name" ;;
    esac
    chmod +x "/tmp/mhla_bin/$name"
  done
  export MHLA_BIN=/tmp/mhla_bin/mhla MHLA_TESTS_BIN=/tmp/mhla_bin/mhla_tests
else
  export MHLA_BIN="$stage/bin/mhla" MHLA_TESTS_BIN="$stage/bin/mhla_tests"
fi
export MHLA_DATA_DIR=${MHLA_DATA_DIR:-$(dirname "$stage")/data}
