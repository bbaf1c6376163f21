#!/usr/bin/env bash
# Copies what a network-less GPU machine needs beside the source tree (git-ignored, sent with the
# device tool's `carry`): the Fashion-MNIST files into data/fashion-mnist, the peer benchmark
# scripts and headers the GPU image lacks (stb) into .gpu_stage/.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$root/data/fashion-mnist" "$root/.gpu_stage/include" "$root/.gpu_stage/bench"
cp -u /usr/share/datasets/fashion-mnist/*.gz "$root/data/fashion-mnist/"
# stb's headers only for building on the GPU machine: staged binaries do not need them, and the
# carry (64 MiB with the tree) is tight beside fla's Triton cache (.gpu_stage/triton_cache.txz).
if [ "${1:-}" != "--binaries" ] && [ -d /usr/include/stb ]; then
  cp -ru /usr/include/stb "$root/.gpu_stage/include/"
else
  rm -rf "$root/.gpu_stage/include/stb"
fi
[ -d "$root/../shared/bench" ] && cp -u "$root"/../shared/bench/*.py "$root/.gpu_stage/bench/"
du -sh "$root/data/fashion-mnist" "$root/.gpu_stage"
# With --binaries: also this machine's build (mhla, mhla_tests, the kernel smoke test) and the
# libraries they need beyond the GPU machine's torch, so a device call can skip its own build
# (source scripts/gpu_env.sh there). Needs a CUDA-enabled build/ (scripts/build.sh with nvcc).
if [ "${1:-}" = "--binaries" ]; then
  mkdir -p "$root/.gpu_stage/bin" "$root/.gpu_stage/lib"
  # Stripped and xz-compressed (a sixth of the size, two thirds of gzip's: carry is limited to
  # 64 MiB a call, and both binaries fit beside data/fashion-mnist only this way);
  # scripts/gpu_env.sh unpacks them on the GPU machine.
  rm -f "$root"/.gpu_stage/bin/*
  for b in build/mhla build/tests/mhla_tests build/kernels/block_linear_smoke \
    build/kernels/warpgroup_mma_smoke; do
    [ -f "$root/$b" ] || continue
    name=$(basename "$b")
    strip -o "$root/.gpu_stage/bin/$name" "$root/$b"
    xz -f -9 -T2 "$root/.gpu_stage/bin/$name"
  done
  for lib in libyaml-cpp.so.0.7 libcudart.so.13; do
    path=$(ldd "$root/build/mhla" | awk -v l=$lib '$1 == l {print $3}')
    [ -n "$path" ] && cp -L "$path" "$root/.gpu_stage/lib/"
  done
  (cd "$root" && git rev-parse HEAD && git status --porcelain) > "$root/.gpu_stage/bin/BUILT_FROM"
  du -sh "$root/.gpu_stage/bin" "$root/.gpu_stage/lib"
fi
