#pragma once
/// Helpers of the gpu tests that run the CUDA engine against the CPU engine on the golden
/// checkpoints (test_cuda_engine.cpp, test_cuda_tp.cpp).

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace pd::testutil {

/// tests/data/golden/<name>.
inline std::filesystem::path golden(const std::string& name) {
  return std::filesystem::path(PD_TEST_DATA_DIR) / "golden" / name;
}

/// Largest |a[i] - b[i]|; a length mismatch fails the test and counts as 1e30.
inline double maxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0.0;
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    worst = std::max(worst, std::fabs(double{a[i]} - double{b[i]}));
  }
  return a.size() == b.size() ? worst : 1e30;
}

/// The greedy token of logits row `row` (vocab entries a row).
inline std::int32_t argmax(const std::vector<float>& logits, std::int64_t row, std::int64_t vocab) {
  const float* r = logits.data() + row * vocab;
  return static_cast<std::int32_t>(std::max_element(r, r + vocab) - r);
}

/// Block ids first, first + stride, ... (count of them): sequences whose blocks interleave.
inline std::vector<std::int32_t> blockTable(std::int64_t first, std::int64_t count, std::int64_t stride) {
  std::vector<std::int32_t> t;
  for (std::int64_t b = 0; b < count; ++b) t.push_back(static_cast<std::int32_t>(first + b * stride));
  return t;
}

}  // namespace pd::testutil
