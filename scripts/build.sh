#!/usr/bin/env bash
# Configures (once) and builds mhla and its tests into build/ (or $BUILD_DIR). Uses the project's
# .venv LibTorch (scripts/setup.sh), ninja and ccache when present, and all cores.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${BUILD_DIR:-$root/build}
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release "$@"
fi
cmake --build "$build" -j "$(nproc)"
