#!/usr/bin/env bash
# Installs what TensorFerry needs to build and test on Debian/Ubuntu (as root, or with sudo).
# Safe to run again: packages already present are kept.
set -euo pipefail
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
PKGS=(cmake ninja-build g++ pkg-config libflatbuffers-dev flatbuffers-compiler libzstd-dev
      libxxhash-dev libgtest-dev libbenchmark-dev libcli11-dev nlohmann-json3-dev
      python3-pip python3-venv bsdutils
      # Remote storage: libcurl (OpenSSL flavour) and libcrypto; nginx and openssl for the tests'
      # HTTP/HTTPS server and its certificate.
      libcurl4-openssl-dev libssl-dev openssl nginx)
missing=()
for p in "${PKGS[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  # The tests start nginx themselves, on 127.0.0.1 only: keep the package from starting its
  # system service (listening on port 80 of every interface) while it installs.
  guard=""
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    guard=/usr/sbin/policy-rc.d
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$guard" >/dev/null
    $SUDO chmod +x "$guard"
  fi
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
  if [ -n "$guard" ]; then $SUDO rm -f "$guard"; fi
fi
PY="${PYTHON:-python3}"
# jax (CPU) is a DLPack consumer for the Python tests; torch is not installed here (its PyPI
# wheel brings gigabytes of CUDA libraries): its tests run on the GPU machines.
if ! "$PY" -c "import numpy, ml_dtypes, pytest, safetensors, jax, hypothesis" >/dev/null 2>&1; then
  "$PY" -m pip install -q numpy ml_dtypes pytest safetensors jax hypothesis \
    || "$PY" -m pip install -q --break-system-packages numpy ml_dtypes pytest safetensors jax hypothesis
fi
# moto's standalone S3 server (the remote-storage tests' S3), pinned: its signature checks and
# error codes are asserted.
MOTO_VERSION=5.2.1
if ! "$PY" -c "import moto, moto.server, flask_cors, boto3; assert moto.__version__ == '$MOTO_VERSION'" >/dev/null 2>&1; then
  "$PY" -m pip install -q "moto[server]==$MOTO_VERSION" \
    || "$PY" -m pip install -q --break-system-packages "moto[server]==$MOTO_VERSION"
fi
