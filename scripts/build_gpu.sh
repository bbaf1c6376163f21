#!/usr/bin/env bash
# Builds on a GPU machine against that machine's own torch (no network needed): CUDA kernels on,
# sm_90a. Headers and data that machine lacks are expected beside the source tree (see
# scripts/stage_gpu.sh, which copies them there from a machine that has them).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${BUILD_DIR:-$root/build-gpu}
python=${PYTHON:-python3}
prefix=$("$python" -c 'import torch; print(torch.utils.cmake_prefix_path)')
extra=()
[ -d "$root/.gpu_stage/include" ] && extra+=(-DCMAKE_CXX_FLAGS="-isystem $root/.gpu_stage/include")
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
  -DMHLA_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a -DTORCH_CUDA_ARCH_LIST=9.0a "${extra[@]}" "$@"
cmake --build "$build" -j "$(nproc)" ${BUILD_TARGET:+--target $BUILD_TARGET}
