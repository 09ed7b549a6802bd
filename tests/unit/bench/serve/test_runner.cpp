// bench serve's runner against a scripted OpenAI-compatible server over real HTTP: measured
// TTFT, ITL, TPOT and throughput agree with the scripted timetable; failures (500, cut stream,
// error event, missing [DONE]) are counted with their errors; Poisson sends keep their schedule;
// the JSON, markdown and SVG reports are well-formed.
#include <gtest/gtest.h>

#include <boost/json.hpp>
#include <cstdlib>
#include <fstream>
#include <numeric>

#include "bench/serve/report.h"
#include "bench/serve/runner.h"
#include "bench/serve/server_metrics.h"
#include "bench/serve/stats.h"
#include "bench/serve/workload.h"
#include "scripted_openai_server.h"
#include "support/test_files.h"

namespace pd::bench {
namespace {

using namespace std::chrono_literals;

Target targetOf(const test::ScriptedOpenAiServer& server) {
  auto t = parseUrl(server.url());
  EXPECT_TRUE(t.ok());
  return t.ok() ? *t : Target{};
}

RequestSpec textRequest(const std::string& prompt) {
  boost::json::object body{{"model", "scripted-model"}, {"prompt", prompt}, {"max_tokens", 8}, {"stream", true}};
  return {boost::json::serialize(body), 0, 8};
}

RequestSpec chatRequest(const std::string& content) {
  boost::json::object body{
      {"model", "scripted-model"},
      {"messages", boost::json::array{boost::json::object{{"role", "user"}, {"content", content}}}},
      {"max_tokens", 8},
      {"stream", true}};
  return {boost::json::serialize(body), 0, 8};
}

TEST(BenchServeRunner, MeasuresTheScriptedTimetable) {
  test::Script script;  // TTFT 40 ms, then chunks of 2, 1, 3, 1 tokens every 15 ms
  test::ScriptedOpenAiServer server(script);
  WorkloadOptions w;
  w.model = "scripted-model";
  w.input_tokens = 16;
  w.output_tokens = 8;
  LevelPlan plan;
  plan.workers = 2;
  plan.warmup = randomRequests(w, 2);
  plan.requests = randomRequests(w, 6);
  plan.timeout = 20s;
  LevelProgress progress;
  const auto run = runLevel(targetOf(server), Endpoint::Completions, plan, &progress);
  EXPECT_EQ(progress.done.load(), 6);
  EXPECT_EQ(progress.failed.load(), 0);
  EXPECT_EQ(server.answered(), 8);  // warm-up included

  // Sleeps only ever run long, so the scripted times are lower bounds of what the client sees from
  // its send: the first chunk no earlier than TTFT, the last no earlier than TTFT + the streaming
  // part. The gaps between chunks have no lower bound (a late first chunk shortens them), and no
  // upper bound holds on a loaded machine. What must hold whatever the load: every measured piece
  // fits inside the request it belongs to, and the summary's figures are the results' arithmetic.
  const double ttft = script.ttft_ms / 1e3;
  const double stream = static_cast<double>(script.chunk_tokens.size() - 1) * script.gap_ms / 1e3;
  const std::int64_t later_tokens = server.totalTokens() - script.chunk_tokens[0];
  ASSERT_EQ(run.results.size(), 6u);
  double e2e_sum = 0;
  double itl_total = 0;
  std::size_t itl_count = 0;
  for (const auto& r : run.results) {
    ASSERT_TRUE(r.ok) << r.error;
    EXPECT_EQ(r.output_tokens, 8);  // from usage
    EXPECT_EQ(r.prompt_tokens, script.prompt_tokens);
    EXPECT_EQ(r.chunks, 5);
    EXPECT_GE(r.ttft_s, ttft * 0.95);
    EXPECT_GE(r.e2e_s, (ttft + stream) * 0.95);
    // One ITL entry per token after the first chunk; together they span the streaming part.
    ASSERT_EQ(static_cast<std::int64_t>(r.itl_s.size()), later_tokens);
    const double itl_sum = std::accumulate(r.itl_s.begin(), r.itl_s.end(), 0.0);
    EXPECT_GE(itl_sum, 0.0);
    // The 2-token chunk's gap is split evenly: its two entries are equal.
    EXPECT_DOUBLE_EQ(r.itl_s[0], r.itl_s[1]);
    EXPECT_DOUBLE_EQ(r.itl_s[3], r.itl_s[4]);
    EXPECT_DOUBLE_EQ(r.itl_s[4], r.itl_s[5]);
    EXPECT_GE(r.e2e_s, r.ttft_s + itl_sum - 1e-9);
    EXPECT_LE(r.e2e_s, run.duration_s + 1e-9);
    e2e_sum += r.e2e_s;
    itl_total += itl_sum;
    itl_count += r.itl_s.size();
  }
  const auto s = summarize(run.results, run.duration_s, Slo{});
  EXPECT_EQ(s.completed, 6);
  EXPECT_EQ(s.failed, 0);
  EXPECT_EQ(s.itl_ms.count, static_cast<std::int64_t>(itl_count));
  EXPECT_NEAR(s.itl_ms.mean, 1e3 * itl_total / static_cast<double>(itl_count), 1e-6);
  EXPECT_GE(s.tpot_ms.p50, 0.0);
  // Three rounds of two concurrent requests, each at least TTFT + stream long; two workers never
  // run more than two requests at once, so the six requests' time is at most twice the run's.
  const double round = ttft + stream;
  EXPECT_GE(run.duration_s, 3 * round * 0.95);
  EXPECT_LE(e2e_sum, 2 * run.duration_s + 1e-9);
  EXPECT_NEAR(s.output_throughput, 48 / run.duration_s, 1e-9);
  EXPECT_GT(s.mean_concurrency, 0.0);
  EXPECT_LE(s.mean_concurrency, 2.0 + 1e-9);
}

TEST(BenchServeRunner, ChatChunksAndTokenCountingWithoutUsage) {
  test::Script script;
  script.ttft_ms = 10;
  script.gap_ms = 5;
  test::ScriptedOpenAiServer server(script);
  LevelPlan plan;
  plan.workers = 1;
  plan.requests = {chatRequest("hello"), chatRequest("no-usage")};
  const auto run = runLevel(targetOf(server), Endpoint::Chat, plan, nullptr);
  ASSERT_EQ(run.results.size(), 2u);
  for (const auto& r : run.results) {
    ASSERT_TRUE(r.ok) << r.error;
    EXPECT_EQ(r.output_tokens, 8);  // usage, then the token ids counted
    EXPECT_EQ(r.chunks, 5);
  }
  EXPECT_EQ(run.results[1].prompt_tokens, 0);  // unknown without usage
}

TEST(BenchServeRunner, CountsFailuresWithTheirErrors) {
  test::Script script;
  script.ttft_ms = 10;
  script.gap_ms = 5;
  test::ScriptedOpenAiServer server(script);
  LevelPlan plan;
  plan.workers = 2;
  plan.requests = {textRequest("ok"),          textRequest("http500"), textRequest("cut"),
                   textRequest("error-event"), textRequest("no-done"), textRequest("ok")};
  plan.timeout = 20s;
  LevelProgress progress;
  const auto run = runLevel(targetOf(server), Endpoint::Completions, plan, &progress);
  EXPECT_EQ(progress.failed.load(), 4);
  ASSERT_EQ(run.results.size(), 6u);
  EXPECT_TRUE(run.results[0].ok) << run.results[0].error;
  EXPECT_TRUE(run.results[5].ok) << run.results[5].error;  // the connection after failures still works
  EXPECT_FALSE(run.results[1].ok);
  EXPECT_EQ(run.results[1].error, "HTTP 500: scripted failure");
  // The cut is a peer failure. The server closes the connection at once, which may drop the
  // chunks it had queued (seen under ASan): a failure after chunks arrived says "stream cut".
  EXPECT_FALSE(run.results[2].ok);
  EXPECT_NE(run.results[2].error.find("PeerFailed"), std::string::npos) << run.results[2].error;
  if (run.results[2].chunks > 0) {
    EXPECT_NE(run.results[2].error.find("stream cut"), std::string::npos) << run.results[2].error;
  }
  EXPECT_FALSE(run.results[3].ok);
  EXPECT_EQ(run.results[3].error, "error event: scripted mid-stream failure");
  EXPECT_FALSE(run.results[4].ok);
  EXPECT_EQ(run.results[4].error, "stream ended before [DONE]");
  const auto s = summarize(run.results, run.duration_s, Slo{});
  EXPECT_EQ(s.completed, 2);
  EXPECT_EQ(s.failed, 4);
  EXPECT_EQ(s.errors.size(), 4u);
  EXPECT_EQ(s.total_output_tokens, 16);  // failed requests add no tokens
}

TEST(BenchServeRunner, UnreachableServerFailsEveryRequest) {
  std::uint16_t port = 0;
  {
    test::ScriptedOpenAiServer gone(test::Script{});
    port = gone.port();
  }
  Target t;
  t.host = "127.0.0.1";
  t.port = port;
  LevelPlan plan;
  plan.workers = 2;
  plan.requests = {textRequest("a"), textRequest("b"), textRequest("c")};
  plan.timeout = 5s;
  const auto run = runLevel(t, Endpoint::Completions, plan, nullptr);
  for (const auto& r : run.results) {
    EXPECT_FALSE(r.ok);
    EXPECT_FALSE(r.error.empty());
  }
}

TEST(BenchServeRunner, PoissonSendsKeepTheirSchedule) {
  test::Script script;
  script.ttft_ms = 5;
  script.gap_ms = 2;
  script.chunk_tokens = {1, 1};
  test::ScriptedOpenAiServer server(script);
  WorkloadOptions w;
  w.model = "scripted-model";
  w.input_tokens = 4;
  w.output_tokens = 2;
  LevelPlan plan;
  plan.workers = 16;
  plan.request_rate = 40;
  plan.seed = 11;
  plan.requests = randomRequests(w, 20);
  const auto due = poissonArrivals(plan.request_rate, 20, plan.seed);
  const auto run = runLevel(targetOf(server), Endpoint::Completions, plan, nullptr);
  for (const auto& r : run.results) ASSERT_TRUE(r.ok) << r.error;
  // The last request goes out no earlier than its due time (sleeps only run long). How late it
  // may run depends on the machine's load, which a unit test does not bound.
  EXPECT_GE(run.duration_s, due.back());
}

TEST(BenchServeRunner, ScrapesMtpCountersFromMetrics) {
  test::Script script;
  script.ttft_ms = 1;
  script.gap_ms = 1;
  test::ScriptedOpenAiServer server(script);
  auto before = scrapeCounters({server.url()}, 5s);
  ASSERT_TRUE(before.ok()) << before.error().toString();
  LevelPlan plan;
  plan.requests = {textRequest("a"), textRequest("b")};
  (void)runLevel(targetOf(server), Endpoint::Completions, plan, nullptr);
  auto after = scrapeCounters({server.url() + "/metrics"}, 5s);
  ASSERT_TRUE(after.ok());
  EXPECT_DOUBLE_EQ(after->at(std::string(kDecodeTokens)) - before->at(std::string(kDecodeTokens)), 16);
  EXPECT_DOUBLE_EQ(after->at(std::string(kMtpAccepted)), 6);
  // Two pages add up (as several decode workers do).
  auto twice = scrapeCounters({server.url(), server.url()}, 5s);
  ASSERT_TRUE(twice.ok());
  EXPECT_DOUBLE_EQ(twice->at(std::string(kMtpProposed)), 16);
  EXPECT_FALSE(scrapeCounters({"http://127.0.0.1:1"}, 2s).ok());
}

// Element tags balance (a small well-formedness check that needs nothing installed).
bool tagsBalance(const std::string& xml, std::string& why) {
  std::vector<std::string> stack;
  std::size_t pos = 0;
  while ((pos = xml.find('<', pos)) != std::string::npos) {
    const auto end = xml.find('>', pos);
    if (end == std::string::npos) {
      why = "unterminated tag";
      return false;
    }
    std::string tag = xml.substr(pos + 1, end - pos - 1);
    pos = end + 1;
    if (tag.starts_with("?") || tag.starts_with("!")) continue;
    if (tag.ends_with("/")) continue;
    if (tag.starts_with("/")) {
      const std::string name = tag.substr(1);
      if (stack.empty() || stack.back() != name) {
        why = "unexpected </" + name + ">";
        return false;
      }
      stack.pop_back();
      continue;
    }
    stack.push_back(tag.substr(0, tag.find_first_of(" \t\n")));
  }
  if (!stack.empty()) why = "unclosed <" + stack.back() + ">";
  return stack.empty();
}

TEST(BenchServeReport, JsonMarkdownAndSvgFromARealRun) {
  test::Script script;
  script.ttft_ms = 5;
  script.gap_ms = 2;
  test::ScriptedOpenAiServer server(script);
  WorkloadOptions w;
  w.model = "scripted-model";
  BenchReport report;
  report.info.url = server.url();
  report.info.model = "scripted <model> & co";  // must be escaped in the SVG
  report.info.endpoint = "completions";
  report.info.prompts = "random";
  report.info.input_tokens = 128;
  report.info.output_tokens = 8;
  report.info.mode = "concurrency";
  report.info.slo.ttft_ms = 1000;
  report.info.net_latency_ms = 0.2;
  for (const std::int64_t c : {1, 2, 4}) {
    LevelPlan plan;
    plan.workers = c;
    plan.requests = randomRequests(w, 4);
    if (c == 4) plan.requests.push_back(textRequest("http500"));
    const auto run = runLevel(targetOf(server), Endpoint::Completions, plan, nullptr);
    auto stats = summarize(run.results, run.duration_s, report.info.slo);
    stats.concurrency = c;
    stats.mtp = mtpFromDeltas(8.0, 6.0, 38.0, 10.0);
    report.levels.push_back(stats);
  }
  // A level with no successes still renders.
  LevelStats empty;
  empty.concurrency = 8;
  empty.failed = 1;
  empty.errors = {{"PeerFailed: connection refused", 1}};
  report.levels.push_back(empty);

  boost::system::error_code ec;
  const auto doc = boost::json::parse(toJson(report), ec);
  ASSERT_FALSE(ec) << ec.message();
  const auto& o = doc.as_object();
  EXPECT_EQ(o.at("mode").as_string(), "concurrency");
  EXPECT_DOUBLE_EQ(o.at("net_latency_ms").as_double(), 0.2);
  const auto& levels = o.at("levels").as_array();
  ASSERT_EQ(levels.size(), 4u);
  const auto& l2 = levels[2].as_object();
  EXPECT_EQ(l2.at("concurrency").as_int64(), 4);
  EXPECT_EQ(l2.at("completed").as_int64(), 4);
  EXPECT_EQ(l2.at("failed").as_int64(), 1);
  EXPECT_EQ(l2.at("errors").as_array()[0].as_object().at("message").as_string(), "HTTP 500: scripted failure");
  EXPECT_GT(l2.at("output_tokens_per_s").as_double(), 0);
  EXPECT_DOUBLE_EQ(l2.at("output_tokens_per_s").as_double(), l2.at("output_throughput").as_double());
  for (const char* key : {"mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_itl_ms",
                          "mean_e2el_ms", "request_throughput", "total_token_throughput", "request_goodput"}) {
    EXPECT_TRUE(l2.contains(key)) << key;
  }
  EXPECT_DOUBLE_EQ(l2.at("mtp").as_object().at("accepted_tokens_per_step").as_double(), 0.1875);

  const std::string md = toMarkdown(report);
  std::vector<std::string> rows;
  std::istringstream lines(md);
  for (std::string line; std::getline(lines, line);) {
    if (line.starts_with("|")) rows.push_back(line);
  }
  ASSERT_EQ(rows.size(), 2u + 4u);  // header, rule, one row per level
  const auto cells = [](const std::string& row) { return std::count(row.begin(), row.end(), '|'); };
  for (const auto& row : rows) EXPECT_EQ(cells(row), cells(rows[0])) << row;
  EXPECT_NE(md.find("MTP accepted / step"), std::string::npos);
  EXPECT_NE(md.find("concurrency 4: 1 × HTTP 500: scripted failure"), std::string::npos) << md;

  const std::string svg = toSvg(report);
  std::string why;
  EXPECT_TRUE(tagsBalance(svg, why)) << why;
  EXPECT_NE(svg.find("scripted &lt;model&gt; &amp; co"), std::string::npos);
  EXPECT_NE(svg.find("<polyline"), std::string::npos);
  EXPECT_NE(svg.find("median TTFT"), std::string::npos);
  EXPECT_NE(svg.find("output tok/s"), std::string::npos);
  // A real XML parser, where python3 is installed.
  if (std::system("python3 -c 'import xml.dom.minidom' >/dev/null 2>&1") == 0) {
    test::TempDir dir;
    const auto file = dir.path() / "chart.svg";
    std::ofstream(file) << svg;
    const std::string cmd =
        "python3 -c 'import sys, xml.dom.minidom; xml.dom.minidom.parse(sys.argv[1])' '" + file.string() + "'";
    EXPECT_EQ(std::system(cmd.c_str()), 0) << "python3 could not parse the SVG";
  }
  // No data at all: still a well-formed document.
  BenchReport none;
  none.info.mode = "request_rate";
  EXPECT_TRUE(tagsBalance(toSvg(none), why)) << why;
}

}  // namespace
}  // namespace pd::bench
