// `pdserve up --device cuda` on a machine without a usable CUDA device: it fails at once with the
// clear "no CUDA device" error, before any worker starts or any file is written (exit 1), and a
// utilization outside (0, 1] is bad input (exit 2).
#include <gtest/gtest.h>

#include <chrono>
#include <string>

#include "pd/engine/gpu.h"
#include "support/cli_runner.h"

namespace {

TEST(UpDevice, CudaWithoutADeviceFailsAtOnceBeforeAnyWorkerStarts) {
  if (pd::gpu::deviceCount() > 0) GTEST_SKIP() << "a CUDA device is visible: scripts/gpu-check.sh covers up --device";
  const auto start = std::chrono::steady_clock::now();
  // --port 0 and --smoke: were the check missing, the cluster would start and answer (exit 0).
  const auto r = pd::test::pdserve({"up", "--device", "cuda", "--smoke", "--port", "0"});
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("pdserve: error: "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("model.device cuda:0: no CUDA device"), std::string::npos) << r.err;
  EXPECT_EQ(r.out.find("PDSERVE_READY"), std::string::npos) << r.out;
  EXPECT_LT(took, std::chrono::seconds(20));  // no model written, no worker started
}

TEST(UpDevice, UtilizationOutsideZeroToOneIsBadInput) {
  for (const char* bad : {"0", "1.5", "-0.2"}) {
    const auto r = pd::test::pdserve({"up", "--device", "cuda", "--gpu_memory_utilization", bad});
    EXPECT_EQ(r.exit_code, 2) << bad << ": " << r.err;
    EXPECT_NE(r.err.find("gpu_memory_utilization"), std::string::npos) << r.err;
  }
}

}  // namespace
