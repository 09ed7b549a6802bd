// `pdserve bench serve` end to end: the real binary against the scripted OpenAI-compatible
// server of this test process (model discovery, a concurrency sweep, JSON/markdown/SVG files,
// MTP counters from --metrics-url, SLO goodput, flag errors, an unreachable server).
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <boost/json.hpp>
#include <cstdlib>
#include <string>
#include <vector>

#include "scripted_openai_server.h"
#include "support/cli_runner.h"
#include "support/test_files.h"

namespace {

using pd::test::readFile;
using pd::test::TempDir;

using pd::test::CommandResult;
using pd::test::pdserve;

pd::test::Script quickScript() {
  pd::test::Script s;
  s.ttft_ms = 5;
  s.gap_ms = 2;
  return s;
}

TEST(BenchServeCli, SweepWritesJsonMarkdownAndSvg) {
  pd::test::ScriptedOpenAiServer server(quickScript());
  TempDir dir;
  const auto json = (dir.path() / "bench.json").string();
  const auto md = (dir.path() / "bench.md").string();
  const auto svg = (dir.path() / "bench.svg").string();
  const auto r = pdserve({"bench",          "serve", "--url",           server.url(),
                          "--concurrency",  "1,2",   "--num-prompts",   "4",
                          "--input-tokens", "8",     "--output-tokens", "8",
                          "--json",         json,    "--markdown",      md,
                          "--svg",          svg,     "--metrics-url",   server.url() + "/metrics",
                          "--slo-ttft-ms",  "5000"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("concurrency 1: 4 ok, 0 failed"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("concurrency 2: 4 ok, 0 failed"), std::string::npos) << r.err;

  boost::system::error_code ec;
  const auto doc = boost::json::parse(readFile(json), ec);
  ASSERT_FALSE(ec) << readFile(json);
  const auto& o = doc.as_object();
  EXPECT_EQ(o.at("model_id").as_string(), "scripted-model");  // from GET /v1/models
  const auto& levels = o.at("levels").as_array();
  ASSERT_EQ(levels.size(), 2u);
  for (std::size_t i = 0; i < 2; ++i) {
    const auto& l = levels[i].as_object();
    EXPECT_EQ(l.at("concurrency").as_int64(), static_cast<std::int64_t>(i + 1));
    EXPECT_EQ(l.at("completed").as_int64(), 4);
    EXPECT_EQ(l.at("total_output_tokens").as_int64(), 32);
    EXPECT_GT(l.at("output_tokens_per_s").as_double(), 0);
    EXPECT_DOUBLE_EQ(l.at("request_goodput").as_double(), l.at("request_throughput").as_double());
    // Per request the server counts 8 tokens and 3 accepted drafts: 3 / (8 - 3) per step.
    EXPECT_DOUBLE_EQ(l.at("mtp").as_object().at("accepted_tokens_per_step").as_double(), 0.6);
    EXPECT_DOUBLE_EQ(l.at("mtp").as_object().at("acceptance_rate").as_double(), 0.75);
  }
  const std::string table = readFile(md);
  EXPECT_NE(table.find("| concurrency |"), std::string::npos) << table;
  EXPECT_NE(table.find("| 2 | 4 | 0 |"), std::string::npos) << table;
  const std::string chart = readFile(svg);
  EXPECT_NE(chart.find("<svg"), std::string::npos);
  EXPECT_NE(chart.find("</svg>"), std::string::npos);
  EXPECT_TRUE(r.out.empty()) << r.out;  // every output went to its file
}

TEST(BenchServeCli, BareJsonGoesToStdoutAndPlannerReadsIt) {
  pd::test::ScriptedOpenAiServer server(quickScript());
  const auto r = pdserve({"bench", "serve", "--url", server.url(), "--model", "scripted-model", "--concurrency", "1",
                          "--num-prompts", "2", "--warmup", "0", "--json", "--quiet", "--endpoint", "chat",
                          "--input-tokens", "4"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(r.err.empty()) << r.err;  // --quiet
  boost::system::error_code ec;
  const auto doc = boost::json::parse(r.out, ec);
  ASSERT_FALSE(ec) << r.out;
  EXPECT_EQ(doc.as_object().at("endpoint").as_string(), "chat");
  EXPECT_EQ(server.answered(), 2);

  TempDir dir;
  const auto file = (dir.path() / "bench.json").string();
  std::ofstream(file) << r.out;
  const auto plan = pdserve({"plan", "--calibrate", file, "--json"});
  EXPECT_EQ(plan.exit_code, 0) << plan.err << plan.out;
}

TEST(BenchServeCli, RequestRateMode) {
  pd::test::ScriptedOpenAiServer server(quickScript());
  const auto r = pdserve(
      {"bench", "serve", "--url", server.url(), "--request-rate", "50", "--num-prompts", "10", "--json", "--quiet"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto doc = boost::json::parse(r.out);
  const auto& l = doc.as_object().at("levels").as_array()[0].as_object();
  EXPECT_DOUBLE_EQ(l.at("request_rate").as_double(), 50);
  EXPECT_FALSE(l.contains("concurrency"));
  EXPECT_EQ(l.at("completed").as_int64(), 10);
}

TEST(BenchServeCli, BadInputGetsAClearError) {
  struct Case {
    std::vector<std::string> args;
    std::string needle;
    int exit_code;  // 2: invalid input; 1: a file that cannot be read
  };
  for (const auto& [args, needle, code] :
       std::vector<Case>{{{"--concurrency", "1,x"}, "--concurrency", 2},
                         {{"--concurrency", "0"}, "--concurrency", 2},
                         {{"--request-rate", "-1"}, "--request-rate", 2},
                         {{"--url", "https://example.com"}, "https", 2},
                         {{"--endpoint", "embeddings"}, "endpoint", 2},
                         {{"--prompts", "/nonexistent.jsonl", "--model", "m"}, "/nonexistent.jsonl", 1},
                         {{"--bogus"}, "unknown flag", 2}}) {
    std::vector<std::string> full{"bench", "serve"};
    full.insert(full.end(), args.begin(), args.end());
    const auto r = pdserve(full);
    EXPECT_EQ(r.exit_code, code) << args[0] << ": " << r.err;
    EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
  }
}

TEST(BenchServeCli, UnreachableServerExitsNonZeroWithTheError) {
  std::string url;
  {
    pd::test::ScriptedOpenAiServer gone(quickScript());
    url = gone.url();
  }
  const auto r = pdserve({"bench", "serve", "--url", url, "--model", "m", "--concurrency", "1", "--num-prompts", "2",
                          "--warmup", "0", "--timeout-s", "5"});
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("0 ok, 2 failed"), std::string::npos) << r.err;
  EXPECT_NE(r.out.find("| 1 | 0 | 2 |"), std::string::npos) << r.out;
}

}  // namespace
