#!/usr/bin/env bash
# Checks that every C++/CUDA source in the tree is clang-format clean (.clang-format at the root).
# With --tidy also runs clang-tidy (.clang-tidy) over the compiled sources of build/ (slow).
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t files < <(git ls-files '*.cpp' '*.h' '*.cu' '*.inc' | grep -v '\.inc$')
bad=0
for f in "${files[@]}"; do
  if ! clang-format --dry-run --Werror "$f" >/dev/null 2>&1; then
    echo "lint: not clang-format clean: $f (run clang-format -i $f)"
    bad=1
  fi
done
if [[ ${1:-} == --tidy ]]; then
  mapfile -t sources < <(git ls-files '*.cpp' | grep -vE '^tests/')
  run-clang-tidy -quiet -p "${PD_BUILD_DIR:-build}" "${sources[@]}" || bad=1
fi
if ((bad)); then exit 1; fi
echo "lint: ${#files[@]} files clang-format clean"
