#!/usr/bin/env bash
# Quick-start command 2: installs what is missing, fetches the tokenizer (sha256-checked), builds,
# and runs every test except those labelled `slow` (GPU tests skip themselves without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
./scripts/fetch-tokenizer.sh
./scripts/build.sh "$@"
ctest --test-dir "${PD_BUILD_DIR:-build}" --output-on-failure -LE slow -j "${PD_JOBS:-$(nproc)}"
