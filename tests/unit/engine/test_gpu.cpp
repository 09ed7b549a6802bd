#include <gtest/gtest.h>

#include <vector>

#include "pd/engine/gpu.h"

namespace {

TEST(Gpu, AxpyMatchesCpu) {
  std::vector<float> x(1000);
  std::vector<float> y(1000);
  std::vector<float> expected(1000);
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = static_cast<float>(i) * 0.5f;
    y[i] = 1.0f - static_cast<float>(i);
    expected[i] = y[i] + 3.0f * x[i];
  }
  if (pd::gpu::deviceCount() == 0) {
    // The CPU-only path must still answer with a clear error, not crash.
    auto status = pd::gpu::axpy(3.0f, x, y);
    ASSERT_FALSE(status.ok());
    EXPECT_EQ(status.error().code, pd::ErrorCode::Unsupported);
    GTEST_SKIP() << "no CUDA device visible (built with CUDA: " << pd::gpu::builtWithCuda() << ")";
  }
  ASSERT_TRUE(pd::gpu::axpy(3.0f, x, y).ok());
  for (size_t i = 0; i < x.size(); ++i) EXPECT_FLOAT_EQ(y[i], expected[i]) << i;
}

TEST(Gpu, AxpyRejectsLengthMismatch) {
  std::vector<float> x(3);
  std::vector<float> y(4);
  auto status = pd::gpu::axpy(1.0f, x, y);
  ASSERT_FALSE(status.ok());
}

}  // namespace
