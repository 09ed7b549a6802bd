// What a user sees from pdserve when --model.device names a CUDA device that is not there (on
// CPU-only machines: a clear "no CUDA device" error before anything loads, never a crash or a
// silent fall-back to the CPU).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

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

TEST(ModelDevice, TensorParallelismOnCudaNeedsAVisibleGpuPerRank) {
  // --check-config accepts it (exit 0: the GPU overlays in deploy/ describe it). Run with the last
  // visible device as the first rank's, the second rank has no GPU: refused at start (exit 1)
  // before any rank spawns; on a machine without a GPU "no CUDA device" comes first.
  const int devices = pd::gpu::deviceCount();
  const std::string device = devices > 0 ? "cuda:" + std::to_string(devices - 1) : "cuda";
  for (const char* role : {"prefill", "decode"}) {
    const std::vector<std::string> args{role,   "--model.device",
                                        device, "--" + std::string(role) + ".tensor_parallel",
                                        "2",    "--" + std::string(role) + ".port",
                                        "0"};
    std::vector<std::string> check = args;
    check.emplace_back("--check-config");
    const auto checked = pd::test::pdserve(check);
    EXPECT_EQ(checked.exit_code, 0) << role << ": " << checked.err;
    const auto run = pd::test::pdserve(args);
    EXPECT_EQ(run.exit_code, 1) << role << ": " << run.err;
    const std::string want =
        devices > 0 ? fmt::format("only {} CUDA device(s) are visible", devices) : std::string("no CUDA device");
    EXPECT_NE(run.err.find(want), std::string::npos) << run.err;
  }
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

// model.numerics (docs/gpu.md "Numerics modes") names the CUDA engine's numerics: bf16 with the
// CPU is bad input (exit 2) for the model commands and the workers' --check-config; with cuda the
// configuration is valid (exit 0), and an unknown mode is bad input.
TEST(ModelDevice, Bf16NumericsNeedTheCudaDevice) {
  const auto gen =
      pd::test::pdserve({"generate", "--model.numerics", "bf16", "--prompt-ids", "1,2,3", "--max-tokens", "1"});
  EXPECT_EQ(gen.exit_code, 2) << gen.err;
  EXPECT_NE(gen.err.find("model.numerics bf16 needs model.device cuda"), std::string::npos) << gen.err;
  EXPECT_TRUE(gen.out.empty()) << gen.out;
  for (const char* role : {"prefill", "decode"}) {
    const auto cpu = pd::test::pdserve({role, "--check-config", "--model.numerics", "bf16"});
    EXPECT_EQ(cpu.exit_code, 2) << role << ": " << cpu.err;
    EXPECT_NE(cpu.err.find("model.numerics bf16 needs model.device cuda"), std::string::npos) << cpu.err;
    const auto cuda =
        pd::test::pdserve({role, "--check-config", "--model.numerics", "bf16", "--model.device", "cuda:0"});
    EXPECT_EQ(cuda.exit_code, 0) << role << ": " << cuda.err;
    const auto bad = pd::test::pdserve({role, "--check-config", "--model.numerics", "fp16"});
    EXPECT_EQ(bad.exit_code, 2) << role << ": " << bad.err;
    EXPECT_NE(bad.err.find("numerics"), std::string::npos) << bad.err;
  }
}

}  // namespace
