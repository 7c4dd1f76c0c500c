#!/usr/bin/env bash
# Installs what TensorFerry needs to build and test on Debian/Ubuntu (as root, or with sudo).
# Safe to run again: packages already present are kept.
set -euo pipefail
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
PKGS=(cmake ninja-build g++ pkg-config libflatbuffers-dev flatbuffers-compiler libzstd-dev
      libxxhash-dev libgtest-dev libbenchmark-dev libcli11-dev nlohmann-json3-dev
      python3-pip python3-venv bsdutils)
missing=()
for p in "${PKGS[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
PY="${PYTHON:-python3}"
# jax (CPU) is a DLPack consumer for the Python tests; torch is not installed here (its PyPI
# wheel brings gigabytes of CUDA libraries): its tests run on the GPU machines.
if ! "$PY" -c "import numpy, ml_dtypes, pytest, safetensors, jax" >/dev/null 2>&1; then
  "$PY" -m pip install -q numpy ml_dtypes pytest safetensors jax \
    || "$PY" -m pip install -q --break-system-packages numpy ml_dtypes pytest safetensors jax
fi
