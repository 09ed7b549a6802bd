#!/usr/bin/env bash
# Quick-start command 1: installs what is missing, builds, and starts a whole local pdserve
# cluster (router + prefill + decode) on the embedded default model (models/tiny-dsv3, compiled
# into the binary with its own tokenizer).
# Arguments go to `pdserve up` (try --help).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh >&2
./scripts/build.sh >&2
exec "${PD_BUILD_DIR:-build}/tools/pdserve" up "$@"
