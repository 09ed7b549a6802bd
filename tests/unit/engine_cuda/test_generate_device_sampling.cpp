// model::generate with device sampling (GenerateOptions::device_sampling, device_sampling.h): the
// rows generate hands a SamplingEngine (draw counter and produced-token counts, per MTP verify
// row) must make the engine's tokens the host Sampler's. Here the SamplingEngine is the CPU
// engine with a fresh host Sampler per row put where the request's would be (resumeAfter), so
// the bookkeeping is checked in every build; tests/gpu/test_cuda_engine.cpp runs the CUDA
// engine's DeviceSampler through the same path.
#include <gtest/gtest.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "pd/engine/device_sampling.h"
#include "pd/engine/engine.h"
#include "pd/engine/generate.h"
#include "pd/engine/sampling.h"
#include "support/host_row_sampling_engine.h"

namespace {

namespace fs = std::filesystem;
using namespace pd::model;

using pd::test_support::HostRowSamplingEngine;

std::unique_ptr<Engine> cpu() {
  CpuEngineOptions o;
  o.threads = 1;
  o.prefault_weights = false;
  auto e = createCpuEngine(fs::path(PD_TEST_DATA_DIR) / "golden" / "tiny-bf16", o);
  EXPECT_TRUE(e.ok()) << e.error().toString();
  return std::move(e).value();
}

TEST(GenerateDeviceSampling, TheEnginesTokensAreTheHostSamplers) {
  auto reference = cpu();
  HostRowSamplingEngine device(cpu());
  const std::vector<std::int32_t> prompt{618, 1600, 791, 1241, 955, 1454, 705, 184, 603, 1292, 1272};
  const std::vector<pd::SamplingParams> cases = pd::test_support::engineSamplingCases();
  for (std::size_t c = 0; c < cases.size(); ++c) {
    for (const std::int64_t drafts : {0, 2}) {
      GenerateOptions o;
      o.max_tokens = 20;
      o.mtp_drafts = drafts;
      o.stop_at_eos = false;
      o.sampling = cases[c];
      auto want = generate(*reference, prompt, o);
      ASSERT_TRUE(want.ok()) << want.error().toString();
      o.device_sampling = true;
      const int before = device.sampled_rows;
      auto got = generate(device, prompt, o);
      ASSERT_TRUE(got.ok()) << got.error().toString();
      EXPECT_GT(device.sampled_rows, before) << "case " << c << ": the engine's sampling was not used";
      EXPECT_EQ(got->tokens, want->tokens) << "case " << c << ", " << drafts << " MTP drafts";
      // Tokens, logprobs and the top alternatives asked for.
      EXPECT_EQ(got->samples, want->samples) << "case " << c << ", " << drafts << " MTP drafts";
      ASSERT_FALSE(got->samples.empty());
      EXPECT_EQ(static_cast<std::int64_t>(got->samples.front().top.size()), cases[c].top_logprobs);
    }
  }
}

TEST(GenerateDeviceSampling, TheDevicesLimitsAreSamplingParamsOwn) {
  pd::SamplingParams p;
  p.top_logprobs = 20;
  p.logit_bias = {{5, 6.0F}};
  EXPECT_TRUE(deviceSamplable(p));
  p.top_logprobs = 21;  // past validate()'s limit: the host would refuse it too
  EXPECT_FALSE(deviceSamplable(p));
  // An engine that is no SamplingEngine samples on the host as before.
  auto plain = cpu();
  GenerateOptions o;
  o.max_tokens = 4;
  o.device_sampling = true;
  o.sampling.top_logprobs = 2;
  auto r = generate(*plain, std::vector<std::int32_t>{1, 2, 3}, o);
  ASSERT_TRUE(r.ok()) << r.error().toString();
  EXPECT_EQ(r->samples.at(0).top.size(), 2U);
}

}  // namespace
