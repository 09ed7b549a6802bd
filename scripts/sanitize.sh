#!/usr/bin/env bash
# The unit tests under AddressSanitizer + UndefinedBehaviorSanitizer, in their own build folder
# (build-asan/, or $PD_ASAN_BUILD_DIR). Builds only what `ctest -L unit` runs (the pd_unit_tests
# target), at -O1 -g1 (test code at -O0) so that the 2-core CI machine builds it in minutes,
# without the CUDA kernels (the unit tests run on the CPU). Any report fails the step: halt_on_error for ASan,
# -fno-sanitize-recover=all for UBSan (cmake/PdTargets.cmake), and leaks are errors.
# Compiled with clang (PD_ASAN_CXX/PD_ASAN_CC to change it), measured on the idle 2-core machine:
# building pd_unit_tests took 583 s (1155 CPU-s) with clang 14 against 957 s (1893 CPU-s) with
# g++ 12, and `ctest -L unit -j2` 300 s against 436 s. It also adds clang's warnings to -Werror.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${PD_ASAN_BUILD_DIR:-build-asan}
cxx=${PD_ASAN_CXX:-clang++}
cc=${PD_ASAN_CC:-clang}
# Test code at -O0 under clang (tests/CMakeLists.txt, PD_TEST_CXX_FLAGS): half the compile time of
# a test file, the same warnings. g++ keeps -O1, which its -Wmaybe-uninitialized needs.
test_flags=()
if [[ $(basename "$cxx") == clang* ]]; then test_flags=(-DPD_TEST_CXX_FLAGS=-O0); fi
cmake -S . -B "$build_dir" -G Ninja -DPD_SANITIZE=address,undefined -DPD_WITH_CUDA=OFF \
  "-DCMAKE_CXX_COMPILER=$cxx" "-DCMAKE_C_COMPILER=$cc" \
  -DCMAKE_BUILD_TYPE=Debug "-DCMAKE_CXX_FLAGS_DEBUG=-O1 -g1" "-DCMAKE_C_FLAGS_DEBUG=-O1 -g1" "${test_flags[@]}" "$@"
cmake --build "$build_dir" --target pd_unit_tests -j "${PD_JOBS:-$(nproc)}"
export ASAN_OPTIONS="halt_on_error=1:abort_on_error=1:detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=1${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
ctest --test-dir "$build_dir" --output-on-failure -L unit --timeout 900 -j "${PD_JOBS:-$(nproc)}"
