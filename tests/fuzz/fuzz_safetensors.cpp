// libFuzzer entry point for the safetensors reader: any byte string must either be rejected with
// an error or yield tensor views that lie inside the input. ASan reports any read outside it.
//
// Build (a separate folder; clang only) and run for a minute on the seed corpus, writing new
// inputs to a scratch folder:
//   cmake -S . -B build-fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_C_COMPILER=clang
//         -DPD_WITH_CUDA=OFF -DPD_BUILD_FUZZERS=ON
//   ninja -C build-fuzz fuzz_safetensors
//   build-fuzz/tests/fuzz/fuzz_safetensors -max_total_time=60 -max_len=4096 /tmp/corpus
//         tests/fuzz/corpus/safetensors
// Add any crash reproducer to tests/fuzz/corpus/safetensors: test_fuzz_safetensors_corpus
// replays that folder in every build.

#include <cstddef>
#include <cstdint>
#include <span>

#include "pd/common/check.h"
#include "pd/engine/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> input = std::as_bytes(std::span(data, size));
  pd::Result<pd::SafetensorsFile> file = pd::SafetensorsFile::fromBytes(input, "fuzz-input");
  if (!file.ok()) {
    PD_CHECK(file.error().code == pd::ErrorCode::Corrupt);
    return 0;
  }
  unsigned checksum = 0;
  for (const pd::TensorView& t : file->tensors()) {
    PD_CHECK(t.data.empty() ||
             (t.data.data() >= input.data() && t.data.data() + t.data.size() <= input.data() + input.size()));
    PD_CHECK(t.data.size() == static_cast<std::size_t>(t.numel()) * pd::dtypeSize(t.dtype));
    PD_CHECK(file->find(t.name) == &t);
    for (const std::byte b : t.data) checksum += std::to_integer<unsigned>(b);
  }
  // Keeps the reads above from being optimized away.
  volatile unsigned sink = checksum;
  static_cast<void>(sink);
  return 0;
}
