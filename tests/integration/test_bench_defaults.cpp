// Defaults that work: every `pdserve bench` subcommand run with no arguments on the embedded
// default model (1,024-token context, 4,096-token vocabulary) succeeds. The only settings given
// are the model cache folder (a temporary one, through the environment, as a user's
// PDSERVE_MODEL_CACHE_DIR would be) and, for bench serve, the router's address (the cluster binds
// any free port, not the default 8000). bench prefill and bench serve run exactly as a user would
// type them, with no flags at all; the longer benches are shortened with flags, which leaves their
// fitting of lengths and token ids to the model in place.
#include <gtest/gtest.h>

#include <chrono>
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
