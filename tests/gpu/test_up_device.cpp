// `pdserve up --device cuda` on one GPU (docs/gpu.md, "The GPU memory plan"): router, prefill and
// decode workers as real processes sharing the device, each with its part of
// gpu_memory_utilization. /v1/completions on the golden prompt ids at temperature 0 must return
// the golden greedy tokens (fp32 numerics) for both golden checkpoints with MTP off and on, twice
// (the second round reuses freed blocks), with KV over UCX from the prefill worker's CUDA engine
// into the decode worker's; afterwards the decode pool is whole again. The golden checkpoints have
// no tokenizer: the embedded default model's (4096 ids, a superset of their 2048) renders ids.
// Where no device is visible the program says so and exits 77 (ctest: skipped).
#include <gtest/gtest.h>

#include <boost/json.hpp>
#include <chrono>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "gpu/gpu_test_main.h"
#include "pd/common/worker_api.h"
#include "support/golden_prompt.h"
#include "support/local_cluster.h"
#include "support/test_files.h"

namespace pd::test {
namespace {

namespace json = boost::json;

class UpDevice : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(UpDevice, CompletionsReturnTheGoldenGreedyTokens) {
  const auto& [model, mtp] = GetParam();
  const GoldenPrompt golden = goldenPrompt(model);
  json::array prompt;
  for (const auto t : golden.tokens) prompt.push_back(t);
  const std::vector<std::int64_t>& greedy = golden.greedy;
  TempDir cache;
  LocalCluster cluster({"--model.path=" + (goldenDir() / model).string(),
                        "--model.tokenizer=" PD_SOURCE_DIR "/models/tiny-dsv3",
                        "--model.cache_dir=" + cache.path().string(), "--router.port=0", "--device=cuda",
                        "--decode.num_speculative_tokens=" + std::to_string(mtp), "--log.level=warn"});
  ASSERT_FALSE(cluster.url().empty());
  for (int i = 0; i < 600 && getPath(cluster.host(), cluster.port(), "/ready").status != 200; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  const json::object body{{"model", "pdserve-default"},
                          {"prompt", prompt},
                          {"max_tokens", greedy.size()},
                          {"temperature", 0},
                          {"return_token_ids", true}};
  for (int round = 0; round < 2; ++round) {
    const auto response = postJson(cluster, "/v1/completions", json::serialize(body));
    ASSERT_EQ(response.status, 200) << response.body;
    const auto out = json::parse(response.body);
    std::vector<std::int64_t> ids;
    for (const auto& t : out.at("choices").as_array().at(0).as_object().at("token_ids").as_array()) {
      ids.push_back(t.to_number<std::int64_t>());
    }
    EXPECT_EQ(ids, greedy) << model << " mtp " << mtp << " round " << round;
  }
  const auto decoders = childUrls(cluster, "decode");
  ASSERT_EQ(decoders.size(), 1U);
  const worker_api::WorkerStatus st = workerStatus(decoders[0], cluster.auth().get());
  EXPECT_EQ(st.free_blocks, st.total_blocks) << "KV blocks leaked";
  // The decode pool is the CUDA engine's GPU memory (the device KV pool), filled through the
  // staging path (UCX here cannot register GPU memory).
  EXPECT_EQ(st.kv_pool_memory, "cuda:0");
  EXPECT_EQ(st.kv_transfer_path, "staging");
  // and the prefill worker's local cache is its engine's GPU memory too
  const auto prefills = childUrls(cluster, "prefill");
  ASSERT_EQ(prefills.size(), 1U);
  EXPECT_EQ(workerStatus(prefills[0], cluster.auth().get()).kv_pool_memory, "cuda:0");
  std::printf("%s mtp %d: golden tokens through up --device cuda; decode pool %s, %lld blocks\n", model.c_str(), mtp,
              st.kv_pool_memory.c_str(), static_cast<long long>(st.total_blocks));
  EXPECT_EQ(cluster.stop(std::chrono::seconds{60}), 0);
}

INSTANTIATE_TEST_SUITE_P(Golden, UpDevice,
                         ::testing::Combine(::testing::Values("tiny-bf16", "tiny-fp8"), ::testing::Values(0, 1)),
                         [](const ::testing::TestParamInfo<std::tuple<std::string, int>>& param_info) {
                           std::string name =
                               std::get<0>(param_info.param) + "_mtp" + std::to_string(std::get<1>(param_info.param));
                           for (char& c : name) c = c == '-' ? '_' : c;
                           return name;
                         });

}  // namespace
}  // namespace pd::test

int main(int argc, char** argv) {
  return pd::testutil::runGpuTests(argc, argv, "the pdserve up --device cuda tests");
}
