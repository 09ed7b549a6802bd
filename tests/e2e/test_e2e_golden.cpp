// The whole system against DeepSeek's reference: /v1/completions on the golden prompt ids with
// temperature 0 returns exactly the golden greedy tokens, through router -> decode (descriptor)
// -> prefill (KV over UCX) -> decode (tokens), for the BF16 and FP8 golden models, with MTP off
// and on, and with a tensor-parallel decode worker (decode.tensor_parallel 2: `pdserve up --tp 2`);
// afterwards every decode worker's KV pool is fully free again. The same tokens come back when KV
// takes the staging path (kvtransfer.path staging: host staging buffers standing in for pinned
// memory, copied to and from the pools) instead of the direct one.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <boost/json.hpp>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "pd/common/worker_api.h"
#include "pd/engine/generate.h"
#include "pd/engine/model_factory.h"
#include "support/golden_prompt.h"
#include "support/local_cluster.h"
#include "support/test_files.h"

namespace pd::test {
namespace {

namespace json = boost::json;

// Command lines of this test process's live descendants (read from /proc).
std::vector<std::string> descendantCommandLines() {
  const auto slurp = [](const std::string& path) {
    std::string out;
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return out;
    char buf[4096];
    ssize_t n = 0;
    while ((n = ::read(fd, buf, sizeof(buf))) > 0) out.append(buf, static_cast<std::size_t>(n));
    ::close(fd);
    return out;
  };
  std::multimap<int, int> children;  // ppid -> pid
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    const std::string name = entry.path().filename().string();
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
    const std::string stat = slurp("/proc/" + name + "/stat");
    const auto close = stat.rfind(')');  // "pid (comm) state ppid ..."
    if (close == std::string::npos || close + 4 >= stat.size() || stat[close + 2] == 'Z') continue;
    children.emplace(std::atoi(stat.c_str() + close + 4), std::stoi(name));
  }
  std::vector<std::string> out;
  std::vector<int> todo{static_cast<int>(::getpid())};
  while (!todo.empty()) {
    const int parent = todo.back();
    todo.pop_back();
    for (auto [it, end] = children.equal_range(parent); it != end; ++it) {
      std::string cmd = slurp("/proc/" + std::to_string(it->second) + "/cmdline");
      for (char& c : cmd) c = c == '\0' ? ' ' : c;
      out.push_back(std::move(cmd));
      todo.push_back(it->second);
    }
  }
  return out;
}

// up prints READY once the router listens; the router routes once its first polls put the
// workers in rotation (its /ready), which may come a moment later on a loaded machine.
void waitUntilRouting(const LocalCluster& cluster) {
  for (int i = 0; i < 600 && getPath(cluster.host(), cluster.port(), "/ready").status != 200; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

// A /v1/completions answer's token ids (first choice); a failure, and no ids, unless it is a 200.
std::vector<std::int64_t> completionTokenIds(const LocalCluster& cluster, const json::object& body) {
  const auto response = postJson(cluster, "/v1/completions", json::serialize(body));
  EXPECT_EQ(response.status, 200) << response.body;
  if (response.status != 200) return {};
  const auto doc = json::parse(response.body);
  std::vector<std::int64_t> ids;
  for (const auto& t : doc.at("choices").as_array().at(0).as_object().at("token_ids").as_array()) {
    ids.push_back(t.to_number<std::int64_t>());
  }
  return ids;
}

// (model, MTP draft tokens, decode tensor-parallel ranks)
class E2eGolden : public ::testing::TestWithParam<std::tuple<std::string, int, int>> {};

TEST_P(E2eGolden, CompletionsReturnTheGoldenGreedyTokens) {
  const auto& [model, mtp, tp] = GetParam();
  const GoldenPrompt golden = goldenPrompt(model);
  TempDir cache;
  LocalCluster cluster({"--model.path=" + (goldenDir() / model).string(), "--model.tokenizer=" PD_TOKENIZER_DIR,
                        "--model.cache_dir=" + cache.path().string(), "--router.port=0",
                        "--decode.num_speculative_tokens=" + std::to_string(mtp), "--tp=" + std::to_string(tp),
                        "--log.level=warn"});
  ASSERT_FALSE(cluster.url().empty());
  waitUntilRouting(cluster);

  json::array prompt;
  for (auto t : golden.tokens) prompt.push_back(t);
  const json::object body{{"model", "pdserve-default"},
                          {"prompt", prompt},
                          {"max_tokens", golden.greedy.size()},
                          {"temperature", 0},
                          {"return_token_ids", true}};
  for (int round = 0; round < 2; ++round) {  // the second round reuses freed blocks
    const auto response = postJson(cluster, "/v1/completions", json::serialize(body));
    ASSERT_EQ(response.status, 200) << response.body;
    const auto doc = json::parse(response.body);
    const auto& choice = doc.at("choices").as_array().at(0).as_object();
    std::vector<std::int64_t> ids;
    for (const auto& t : choice.at("token_ids").as_array()) ids.push_back(t.to_number<std::int64_t>());
    EXPECT_EQ(ids, golden.greedy) << "round " << round;
    EXPECT_EQ(choice.at("finish_reason").as_string(), "length");
    const auto& usage = doc.at("usage").as_object();
    EXPECT_EQ(usage.at("prompt_tokens").to_number<std::int64_t>(), static_cast<std::int64_t>(golden.tokens.size()));
    EXPECT_EQ(usage.at("completion_tokens").to_number<std::int64_t>(), static_cast<std::int64_t>(golden.greedy.size()));
  }

  if (tp > 1) {  // the decode worker really runs tensor-parallel: its followers exist
    int followers = 0;
    for (const auto& cmd : descendantCommandLines()) followers += cmd.find("--decode.tp_rank") != std::string::npos;
    EXPECT_EQ(followers, tp - 1) << "tensor-parallel follower processes under pdserve up";
  }
  const auto decoders = childUrls(cluster, "decode");
  ASSERT_EQ(decoders.size(), 1U);
  const auto st = workerStatus(decoders[0], cluster.auth().get());
  {  // The cluster's internal plane is authenticated: an unsigned status call is refused.
    const auto colon = decoders[0].rfind(':');
    EXPECT_EQ(
        getPath(decoders[0].substr(0, colon), static_cast<std::uint16_t>(std::stoi(decoders[0].substr(colon + 1))),
                std::string(worker_api::kStatusPath))
            .status,
        401);
  }
  EXPECT_GT(st.total_blocks, 0);
  EXPECT_EQ(st.free_blocks, st.total_blocks) << "KV blocks leaked";
  EXPECT_EQ(st.kv_transfer_path, "direct");  // kvtransfer.path auto with a host pool
  EXPECT_EQ(st.running_requests, 0);
  EXPECT_EQ(cluster.stop(std::chrono::seconds{60}), 0);
}

// kvtransfer.path staging on both workers: every KV byte goes pool -> staging -> UCX -> staging ->
// pool, and the tokens are still the golden greedy ones (those the direct path returns above).
// With a tensor-parallel decode worker (`--tp 2`) each rank's staging transport grants staging
// blocks of its own, which the descriptor names per rank (KvTarget::block_ids), and the leader
// runs a request only once every rank holds its KV (TpLeaderEngine::awaitKv).
class E2eGoldenStaging : public ::testing::TestWithParam<int> {};

TEST_P(E2eGoldenStaging, TheStagingPathReturnsTheGoldenGreedyTokens) {
  const int tp = GetParam();
  const std::string model = "tiny-bf16";
  const GoldenPrompt golden = goldenPrompt(model);
  TempDir cache;
  LocalCluster cluster({"--model.path=" + (goldenDir() / model).string(), "--model.tokenizer=" PD_TOKENIZER_DIR,
                        "--model.cache_dir=" + cache.path().string(), "--router.port=0",
                        "--decode.num_speculative_tokens=1", "--kvtransfer.path=staging", "--tp=" + std::to_string(tp),
                        "--log.level=warn"});
  ASSERT_FALSE(cluster.url().empty());
  waitUntilRouting(cluster);
  json::array prompt;
  for (auto t : golden.tokens) prompt.push_back(t);
  const json::object body{{"model", "pdserve-default"},
                          {"prompt", prompt},
                          {"max_tokens", golden.greedy.size()},
                          {"temperature", 0},
                          {"return_token_ids", true}};
  for (int round = 0; round < 2; ++round) {  // the second round reuses freed pool and staging blocks
    const std::vector<std::int64_t> ids = completionTokenIds(cluster, body);
    EXPECT_EQ(ids, golden.greedy) << "round " << round;
  }
  if (tp > 1) {
    int followers = 0;
    for (const auto& cmd : descendantCommandLines()) followers += cmd.find("--decode.tp_rank") != std::string::npos;
    EXPECT_EQ(followers, tp - 1) << "tensor-parallel follower processes under pdserve up";
  }
  const auto decoders = childUrls(cluster, "decode");
  const auto prefills = childUrls(cluster, "prefill");
  ASSERT_EQ(decoders.size(), 1U);
  ASSERT_EQ(prefills.size(), 1U);
  const auto st = workerStatus(decoders[0], cluster.auth().get());
  EXPECT_EQ(st.kv_transfer_path, "staging");
  EXPECT_EQ(st.free_blocks, st.total_blocks) << "KV blocks leaked";
  EXPECT_EQ(workerStatus(prefills[0], cluster.auth().get()).kv_transfer_path, "staging");
  EXPECT_EQ(cluster.stop(std::chrono::seconds{60}), 0);
}

// An FP8 KV cache on both workers (decode.kv_dtype fp8, prefill.kv_dtype fp8: e4m3 tokens with a
// float32 scale per 64 values, pd/common/kv_format.h), MTP on: the tokens are those the engine
// generates in one process on an FP8 cache (model::generate), twice; the KV crossing the wire is
// FP8 (612-byte tokens for DeepSeek-V3, here the golden model's latent); both workers report the
// dtype and the pool is whole again afterwards. On both KV paths: direct, and staging (612-byte
// tokens through the host staging buffers and copiers).
class E2eGoldenFp8Kv : public ::testing::TestWithParam<std::string> {};

TEST_P(E2eGoldenFp8Kv, AnFp8PoolServesWhatAnFp8CacheGeneratesInOneProcess) {
  const std::string path = GetParam();
  const std::string model = "tiny-bf16";
  const GoldenPrompt golden = goldenPrompt(model);
  auto engine = model::createCpuEngine(goldenDir() / model, model::CpuEngineOptions{2, std::nullopt});
  ASSERT_TRUE(engine.ok()) << engine.error().toString();
  const std::vector<std::int32_t> prompt_ids(golden.tokens.begin(), golden.tokens.end());
  model::GenerateOptions go;
  go.max_tokens = static_cast<std::int64_t>(golden.greedy.size());
  go.stop_at_eos = false;
  go.mtp_drafts = 1;
  go.cache_dtype = DType::F8E4M3;
  auto expected = model::generate(**engine, prompt_ids, go);
  ASSERT_TRUE(expected.ok()) << expected.error().toString();
  const std::vector<std::int64_t> want(expected->tokens.begin(), expected->tokens.end());

  TempDir cache;
  LocalCluster cluster({"--model.path=" + (goldenDir() / model).string(), "--model.tokenizer=" PD_TOKENIZER_DIR,
                        "--model.cache_dir=" + cache.path().string(), "--router.port=0",
                        "--decode.num_speculative_tokens=1", "--decode.kv_dtype=fp8", "--prefill.kv_dtype=fp8",
                        "--kvtransfer.path=" + path, "--log.level=warn"});
  ASSERT_FALSE(cluster.url().empty());
  waitUntilRouting(cluster);
  json::array prompt;
  for (auto t : golden.tokens) prompt.push_back(t);
  const json::object body{{"model", "pdserve-default"}, {"prompt", prompt},   {"max_tokens", golden.greedy.size()},
                          {"temperature", 0},           {"ignore_eos", true}, {"return_token_ids", true}};
  for (int round = 0; round < 2; ++round) {  // the second round reuses freed blocks
    const std::vector<std::int64_t> ids = completionTokenIds(cluster, body);
    EXPECT_EQ(ids, want) << "round " << round;
  }
  const auto decoders = childUrls(cluster, "decode");
  ASSERT_EQ(decoders.size(), 1U);
  const auto st = workerStatus(decoders[0], cluster.auth().get());
  EXPECT_EQ(st.kv_cache_dtype, "fp8");
  EXPECT_EQ(st.kv_transfer_path, path == "staging" ? "staging" : "direct");
  EXPECT_EQ(st.free_blocks, st.total_blocks) << "KV blocks leaked";
  EXPECT_EQ(cluster.stop(std::chrono::seconds{60}), 0);
}

INSTANTIATE_TEST_SUITE_P(Ranks, E2eGoldenStaging, ::testing::Values(1, 2),
                         [](const ::testing::TestParamInfo<int>& ranks) { return "tp" + std::to_string(ranks.param); });
INSTANTIATE_TEST_SUITE_P(Paths, E2eGoldenFp8Kv, ::testing::Values("auto", "staging"));

std::string goldenCaseName(const ::testing::TestParamInfo<std::tuple<std::string, int, int>>& info) {
  std::string name = std::get<0>(info.param) + "_mtp" + std::to_string(std::get<1>(info.param));
  if (std::get<2>(info.param) != 1) name += "_tp" + std::to_string(std::get<2>(info.param));
  for (auto& ch : name) ch = (ch == '-') ? '_' : ch;
  return name;
}

INSTANTIATE_TEST_SUITE_P(Models, E2eGolden,
                         ::testing::Combine(::testing::Values("tiny-bf16", "tiny-fp8"), ::testing::Values(0, 1, 2),
                                            ::testing::Values(1)),
                         goldenCaseName);
// Decode tensor parallelism: `pdserve up --tp 2`, MTP off and on.
INSTANTIATE_TEST_SUITE_P(TensorParallel, E2eGolden,
                         ::testing::Combine(::testing::Values("tiny-bf16", "tiny-fp8"), ::testing::Values(0, 1),
                                            ::testing::Values(2)),
                         goldenCaseName);

}  // namespace
}  // namespace pd::test
