// Replays a fuzz corpus through a libFuzzer entry point as an ordinary test, so every build (gcc,
// no libFuzzer) re-checks the seeds and any crash reproducers added to tests/fuzz/corpus/.

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

// The suite name says which corpus; the safetensors replay keeps its historical name.
#ifndef PD_FUZZ_CORPUS_SUITE
#define PD_FUZZ_CORPUS_SUITE SafetensorsFuzzCorpus
#endif

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size);

namespace {

TEST(PD_FUZZ_CORPUS_SUITE, EveryCorpusFileAndEveryPrefixIsHandled) {
  const std::filesystem::path dir = PD_FUZZ_CORPUS_DIR;
  ASSERT_TRUE(std::filesystem::is_directory(dir)) << dir;
  std::size_t files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (!entry.is_regular_file()) continue;
    std::ifstream in(entry.path(), std::ios::binary);
    const std::vector<char> chars((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::vector<std::uint8_t> bytes(chars.begin(), chars.end());
    // Each prefix, copied into an exactly sized buffer so a sanitizer build sees any overread.
    for (std::size_t n = 0; n <= bytes.size(); ++n) {
      const std::vector<std::uint8_t> prefix(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(n));
      EXPECT_EQ(LLVMFuzzerTestOneInput(prefix.data(), prefix.size()), 0);
    }
    ++files;
  }
  EXPECT_GE(files, 3U);
}

}  // namespace
