#!/usr/bin/env bash
# Copies what a network-less GPU machine needs beside the source tree (git-ignored, sent with the
# device tool's `carry`): the Fashion-MNIST files into data/fashion-mnist, the peer benchmark
# scripts and headers the GPU image lacks (stb) into .gpu_stage/.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$root/data/fashion-mnist" "$root/.gpu_stage/include" "$root/.gpu_stage/bench"
cp -u /usr/share/datasets/fashion-mnist/*.gz "$root/data/fashion-mnist/"
[ -d /usr/include/stb ] && cp -ru /usr/include/stb "$root/.gpu_stage/include/"
[ -d "$root/../shared/bench" ] && cp -u "$root"/../shared/bench/*.py "$root/.gpu_stage/bench/"
du -sh "$root/data/fashion-mnist" "$root/.gpu_stage"
