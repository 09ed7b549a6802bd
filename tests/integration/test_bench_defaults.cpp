// Defaults that work: every `pdserve bench` subcommand run with no arguments on the embedded
// default model (1,024-token context, 4,096-token vocabulary) succeeds. The only settings given
// are the model cache folder (a temporary one, through the environment, as a user's
// PDSERVE_MODEL_CACHE_DIR would be) and, for bench serve, the router's address (the cluster binds
// any free port, not the default 8000). bench prefill and bench serve run exactly as a user would
// type them, with no flags at all; the longer benches are shortened with flags, which leaves their
// fitting of lengths and token ids to the model in place.
#include <gtest/gtest.h>

#include <boost/json.hpp>
#include <chrono>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "pd/common/subprocess.h"
#include "support/local_cluster.h"
#include "support/test_files.h"

namespace pd::test {
namespace {

using namespace std::chrono_literals;

struct CommandRun {
  std::optional<int> exit_code;  // nullopt: still running at the deadline (killed)
  std::string out;
  std::string err;
};

// Runs `pdserve args...` with `env` added, collecting its output, for up to `timeout`.
CommandRun pdserve(const std::vector<std::string>& args, std::vector<std::pair<std::string, std::string>> env,
                   std::chrono::seconds timeout) {
  proc::SpawnOptions o;
  o.argv = {PD_PDSERVE_BIN};
  o.argv.insert(o.argv.end(), args.begin(), args.end());
  o.env = std::move(env);
  CommandRun run;
  auto child = proc::Subprocess::spawn(o);
  if (!child.ok()) {
    ADD_FAILURE() << child.error().toString();
    return run;
  }
  proc::LineReader out((*child)->stdoutFd());
  proc::LineReader err((*child)->stderrFd());
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while ((!out.eof() || !err.eof()) && std::chrono::steady_clock::now() < deadline) {
    if (auto line = out.next(50ms)) run.out += *line + "\n";
    err.drain([&](const std::string& line) { run.err += line + "\n"; });
  }
  run.exit_code = (*child)->wait(out.eof() ? 30s : 0s);
  return run;
}

class BenchDefaults : public ::testing::Test {
 protected:
  std::vector<std::pair<std::string, std::string>> env() const {
    return {{"PDSERVE_MODEL_CACHE_DIR", cache_.path().string()}, {"PDSERVE_LOG_LEVEL", "warn"}};
  }
  TempDir cache_;
};

TEST_F(BenchDefaults, PrefillWithNoArgumentsFitsItsLengthsToTheContext) {
  const CommandRun r = pdserve({"bench", "prefill"}, env(), 600s);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  // 512 and the 1,024-token context (2,048 and 8,192 do not fit), the headline at the nearest.
  EXPECT_NE(r.out.find("\n     512 "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\n    1024 "), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("2048 "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("streaming_overhead (1024 tokens): "), std::string::npos) << r.out;
}

TEST_F(BenchDefaults, PrefillRefusesGivenLengthsBeyondTheContext) {
  const CommandRun r = pdserve({"bench", "prefill", "--lengths", "2048"}, env(), 120s);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("context of 1024 tokens"), std::string::npos) << r.err;
}

TEST_F(BenchDefaults, ServeWithNoArgumentsAgainstUpSucceeds) {
  LocalCluster cluster({"--model.cache_dir=" + cache_.path().string(), "--router.port=0", "--log.level=warn"});
  ASSERT_FALSE(cluster.url().empty());
  auto e = env();
  e.emplace_back("PDSERVE_BENCH_SERVE_URL", cluster.url());
  e.emplace_back("PDSERVE_BENCH_SERVE_QUIET", "true");
  const CommandRun r = pdserve({"bench", "serve"}, e, 600s);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  // Every level completed every request: the markdown table has no failures column above 0.
  EXPECT_EQ(r.err.find("completed no request"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("failed"), std::string::npos) << r.err;
}

// With the workers' /metrics pages (`pdserve up` prints their addresses), bench serve reports the
// prefill workers' own time per prompt next to TTFT: every timed prompt of a level is counted once,
// the KV bytes per prompt are exactly the prompt's latent KV (tokens x KV layers x BF16 latent), and
// the times are positive, the KV tail (what the transfer adds to TTFT) below the mean TTFT.
TEST_F(BenchDefaults, ServeReportsThePrefillWorkersTimePerPrompt) {
  LocalCluster cluster({"--model.cache_dir=" + cache_.path().string(), "--router.port=0", "--log.level=warn"});
  ASSERT_FALSE(cluster.url().empty());
  const auto prefills = childUrls(cluster, "prefill");
  const auto decoders = childUrls(cluster, "decode");
  ASSERT_EQ(prefills.size(), 1U);
  ASSERT_EQ(decoders.size(), 1U);
  TempDir out;
  const std::string json_path = (out.path() / "serve.json").string();
  auto e = env();
  const CommandRun r =
      pdserve({"bench", "serve", "--url", cluster.url(), "--metrics_url",
               "http://" + prefills[0] + ",http://" + decoders[0], "--concurrency", "1,3", "--num_prompts", "6",
               "--input_tokens", "100", "--output_tokens", "8", "--quiet", "--json", json_path},
              e, 600s);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("| prefill ms / prompt | KV tail ms / prompt | KV transfer ms / prompt |"), std::string::npos)
      << r.out;
  // The embedded model's KV per token: its KV layers (main + MTP) x (kv_lora_rank + rope dims) x 2.
  std::filesystem::path model_dir;
  for (const auto& entry : std::filesystem::directory_iterator(cache_.path() / "models")) {
    if (std::filesystem::exists(entry.path() / "config.json")) model_dir = entry.path();
  }
  ASSERT_FALSE(model_dir.empty()) << "no model in " << cache_.path();
  const auto config = boost::json::parse(readFile(model_dir / "config.json")).as_object();
  const auto num = [&](const char* key) { return config.at(key).to_number<std::int64_t>(); };
  const std::int64_t token_bytes = (num("num_hidden_layers") + num("num_nextn_predict_layers")) *
                                   (num("kv_lora_rank") + num("qk_rope_head_dim")) * 2;
  const auto doc = boost::json::parse(readFile(json_path)).as_object();
  const auto& levels = doc.at("levels").as_array();
  ASSERT_EQ(levels.size(), 2U);
  for (const auto& value : levels) {
    const auto& level = value.as_object();
    ASSERT_TRUE(level.contains("prefill")) << boost::json::serialize(level);
    const auto& p = level.at("prefill").as_object();
    EXPECT_EQ(p.at("prompts").to_number<double>(), level.at("completed").to_number<double>());
    EXPECT_EQ(p.at("kv_bytes_per_prompt").to_number<double>(), static_cast<double>(100 * token_bytes));
    for (const char* key : {"queue_ms_mean", "compute_ms_mean", "kv_tail_ms_mean", "kv_transfer_ms_mean"}) {
      EXPECT_TRUE(p.at(key).is_number()) << key;
    }
    EXPECT_GT(p.at("compute_ms_mean").to_number<double>(), 0.0);
    EXPECT_GT(p.at("kv_tail_ms_mean").to_number<double>(), 0.0);
    EXPECT_LT(p.at("kv_tail_ms_mean").to_number<double>(), level.at("mean_ttft_ms").to_number<double>());
  }
  // The file calibrates the planner as it is (what scripts/gpu-check.sh does with a GPU run's).
  const CommandRun plan = pdserve({"plan", "--calibrate", json_path, "--model", model_dir.string(), "--decode-tp", "1",
                                   "--nodes", "1", "--input-len", "100", "--output-len", "8"},
                                  e, 120s);
  ASSERT_EQ(plan.exit_code, 0) << plan.err;
  EXPECT_NE(plan.out.find("| concurrency | network ms | measured tok/s | predicted tok/s | predicted / measured |"),
            std::string::npos)
      << plan.out;
}

// The other benchmarks: defaults except for how long they run.
struct ShortBench {
  const char* name;
  std::vector<std::string> flags;
};

class BenchDefaultsShort : public BenchDefaults, public ::testing::WithParamInterface<ShortBench> {};

TEST_P(BenchDefaultsShort, SucceedsOnTheDefaultModel) {
  std::vector<std::string> args{"bench", GetParam().name};
  args.insert(args.end(), GetParam().flags.begin(), GetParam().flags.end());
  const CommandRun r = pdserve(args, env(), 600s);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
}

INSTANTIATE_TEST_SUITE_P(
    Bench, BenchDefaultsShort,
    ::testing::Values(ShortBench{"engine", {"--bandwidth-mb", "64", "--batches", "1,4", "--steps", "2"}},
                      ShortBench{"decode",
                                 {"--model", "default", "--bandwidth-mb", "64", "--batches", "1,4", "--steps", "2"}},
                      ShortBench{"kv", {"--runs", "2"}}, ShortBench{"comm", {"--iterations", "200"}},
                      ShortBench{"router", {"--concurrency", "1,4", "--requests", "16", "--warmup", "2"}}),
    [](const auto& param_info) { return std::string(param_info.param.name); });

}  // namespace
}  // namespace pd::test
