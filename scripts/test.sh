#!/usr/bin/env bash
# Quick-start command 2: installs what is missing, fetches the tokenizer (sha256-checked), builds,
# and runs every test except those labelled `slow` (GPU tests skip themselves without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
./scripts/fetch-tokenizer.sh
./scripts/build.sh "$@"
# --timeout: a test that hangs fails after 15 minutes instead of holding the run (tests with a
# TIMEOUT property of their own keep it).
ctest --test-dir "${PD_BUILD_DIR:-build}" --output-on-failure -LE slow --timeout 900 -j "${PD_JOBS:-$(nproc)}"
