// libFuzzer entry point for the KV wire decoders (descriptor, completion and failure records):
// any byte string must be rejected with an error or decode to a message that re-encodes to the
// same bytes; validated descriptors must plan puts only inside their regions (kv_wire_oracle.h).
//
//   cmake -S . -B build-fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_C_COMPILER=clang
//         -DPD_WITH_CUDA=OFF -DPD_BUILD_FUZZERS=ON   (one command line)
//   ninja -C build-fuzz fuzz_kv_wire
//   build-fuzz/tests/fuzz/fuzz_kv_wire -max_total_time=60 tests/fuzz/corpus/kv_wire

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <span>

#include "kv_wire_oracle.h"

// NOLINTNEXTLINE(readability-identifier-naming): the name libFuzzer looks for
extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string problem = pd::kvtransfer::fuzz::checkKvWireInput(std::span(data, size));
  if (!problem.empty()) {
    std::fprintf(stderr, "fuzz_kv_wire: %s\n", problem.c_str());
    __builtin_trap();
  }
  return 0;
}
