#!/usr/bin/env bash
# Installs everything mhla needs on a fresh Debian 12 machine. Idempotent: re-running it
# only checks that each piece is present.
#   - Debian dev packages (compiler deps, libraries, the Fashion-MNIST data package)
#   - LibTorch from PyPI torch==2.11.0 into a project-local venv (.venv), never system-wide
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

debs=(build-essential cmake ninja-build ccache pkg-config python3-venv
      libyaml-cpp-dev libspdlog-dev libfmt-dev libcli11-dev catch2 libstb-dev zlib1g-dev
      nlohmann-json3-dev dataset-fashion-mnist)
missing=()
for p in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "[setup] installing Debian packages: ${missing[*]}"
  sudo_cmd=""; [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "[setup] Debian packages present"
fi

py=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$py" -m venv .venv
fi
if ! .venv/bin/python -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.11.0") else 1)' 2>/dev/null; then
  echo "[setup] installing torch==2.11.0 into .venv (large download)"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q torch==2.11.0 numpy safetensors
else
  echo "[setup] torch $(.venv/bin/python -c 'import torch; print(torch.__version__)') present in .venv"
fi

if [ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
  echo "[setup] Fashion-MNIST not found under /usr/share/datasets/fashion-mnist" >&2
  exit 1
fi
echo "[setup] done"
