// What a user sees from pdserve when --model.device names a CUDA device that is not there (on
// CPU-only machines: a clear "no CUDA device" error before anything loads, never a crash or a
// silent fall-back to the CPU).
#include <gtest/gtest.h>

#include <string>

#include "pd/engine/gpu.h"
#include "support/cli_runner.h"

namespace {

TEST(ModelDevice, PdserveGenerateOnAMissingCudaDeviceFailsClearly) {
  if (pd::gpu::deviceCount() > 0) GTEST_SKIP() << "a CUDA device is visible: tests/gpu runs generate on it";
  const auto r =
      pd::test::pdserve({"generate", "--model.device", "cuda", "--prompt-ids", "1,2,3", "--max-tokens", "1"});
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_TRUE(r.out.empty()) << r.out;
  const std::string want = "no CUDA device";
  EXPECT_NE(r.err.find("pdserve: error: "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(want), std::string::npos) << r.err;
  // A malformed device is bad input (exit 2), and cpu still works as before.
  const auto bad = pd::test::pdserve({"generate", "--model.device", "tpu", "--prompt-ids", "1,2,3"});
  EXPECT_EQ(bad.exit_code, 2) << bad.err;
  EXPECT_NE(bad.err.find("model.device 'tpu'"), std::string::npos) << bad.err;
}

TEST(ModelDevice, DecodeWorkerOnAMissingCudaDeviceFailsBeforeLoading) {
  if (pd::gpu::deviceCount() > 0) GTEST_SKIP() << "a CUDA device is visible: the worker would serve on it";
  const auto r = pd::test::pdserve({"decode", "--model.device", "cuda:0", "--decode.port", "0"});
  EXPECT_EQ(r.exit_code, 1) << r.err;
  const std::string want = "no CUDA device";
  EXPECT_NE(r.err.find(want), std::string::npos) << r.err;
}

TEST(ModelDevice, WorkersRefuseTensorParallelismOnCudaAsBadConfig) {
  // Checked with the configuration (exit 2, --check-config catches it), GPU or not.
  for (const char* role : {"prefill", "decode"}) {
    const auto r = pd::test::pdserve(
        {role, "--model.device", "cuda", "--" + std::string(role) + ".tensor_parallel", "2", "--check-config"});
    EXPECT_EQ(r.exit_code, 2) << role << ": " << r.err;
    EXPECT_NE(r.err.find(std::string(role) + ".tensor_parallel > 1 runs on the CPU engine only"), std::string::npos)
        << r.err;
  }
  const auto cpu = pd::test::pdserve({"decode", "--decode.tensor_parallel", "2", "--check-config"});
  EXPECT_EQ(cpu.exit_code, 0) << cpu.err;
}

TEST(ModelDevice, BenchEngineOnAMissingCudaDeviceFailsClearly) {
  if (pd::gpu::deviceCount() > 0) GTEST_SKIP() << "a CUDA device is visible: scripts/gpu-check.sh runs the benchmark";
  for (const char* device : {"cuda", "cuda:1"}) {
    const auto r = pd::test::pdserve({"bench", "engine", "--device", device, "--json"});
    EXPECT_EQ(r.exit_code, 1) << device << ": " << r.err;
    EXPECT_TRUE(r.out.empty()) << r.out;
    EXPECT_NE(r.err.find("pdserve: error: "), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("bench engine --device " + std::string(device == std::string("cuda") ? "cuda:0" : device) +
                         ": no CUDA device"),
              std::string::npos)
        << r.err;
  }
  // A malformed device is bad input (exit 2) and names the value.
  const auto bad = pd::test::pdserve({"bench", "engine", "--device", "gpu0"});
  EXPECT_EQ(bad.exit_code, 2) << bad.err;
  EXPECT_NE(bad.err.find("'gpu0'"), std::string::npos) << bad.err;
}

}  // namespace
