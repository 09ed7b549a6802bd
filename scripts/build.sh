#!/usr/bin/env bash
# Configures and builds pdserve into build/ (or $PD_BUILD_DIR). Extra arguments go to cmake's
# configure step, e.g. -DPD_SANITIZE=address,undefined or -DPD_WITH_CUDA=OFF.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${PD_BUILD_DIR:-build}
cmake -S . -B "$build_dir" -G Ninja "$@"
cmake --build "$build_dir" -j "${PD_JOBS:-$(nproc)}"
