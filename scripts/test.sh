#!/usr/bin/env bash
# Quick-start command 2: installs what is missing, fetches the tokenizer (sha256-checked), builds,
# and runs every test except those labelled `slow` (GPU tests skip themselves without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
./scripts/fetch-tokenizer.sh
./scripts/build.sh "$@"
# Large malloc blocks on transparent huge pages, in ctest and every process the tests start: the
# end-to-end tests start whole clusters, and page faults were a third of their CPU time (see
# tools/cluster/cluster_supervisor.cpp, which sets the same for `pdserve up`'s children).
export GLIBC_TUNABLES=${GLIBC_TUNABLES:-glibc.malloc.hugetlb=1}
# --timeout: a test that hangs fails after 15 minutes instead of holding the run (tests with a
# TIMEOUT property of their own keep it).
ctest --test-dir "${PD_BUILD_DIR:-build}" --output-on-failure -LE slow --timeout 900 -j "${PD_JOBS:-$(nproc)}"
