// bench serve's statistics, request generation and parsers on hand-computed examples:
// percentiles, TPOT, ITL of multi-token chunks, goodput, MTP deltas, Poisson arrivals, request
// bodies, JSONL prompt files, Prometheus text and URLs.
#include <gtest/gtest.h>

#include <boost/json.hpp>
#include <cmath>
#include <numeric>

#include "bench/serve/report.h"
#include "bench/serve/runner.h"
#include "bench/serve/server_metrics.h"
#include "bench/serve/stats.h"
#include "bench/serve/workload.h"

namespace pd::bench {
namespace {

RequestResult okResult(double ttft_s, double e2e_s, std::int64_t out, std::int64_t in = 10) {
  RequestResult r;
  r.ok = true;
  r.ttft_s = ttft_s;
  r.e2e_s = e2e_s;
  r.output_tokens = out;
  r.prompt_tokens = in;
  return r;
}

TEST(BenchServeStats, PercentilesInterpolateLinearlyLikeNumpy) {
  // numpy.percentile([4, 1, 3, 2], [50, 90, 99]) == [2.5, 3.7, 3.97]
  const std::vector<double> v{4, 1, 3, 2};
  EXPECT_DOUBLE_EQ(percentile(v, 50), 2.5);
  EXPECT_NEAR(percentile(v, 90), 3.7, 1e-12);
  EXPECT_NEAR(percentile(v, 99), 3.97, 1e-12);
  EXPECT_DOUBLE_EQ(percentile(v, 0), 1);
  EXPECT_DOUBLE_EQ(percentile(v, 100), 4);
  EXPECT_DOUBLE_EQ(percentile({7}, 99), 7);
  EXPECT_DOUBLE_EQ(percentile({}, 50), 0);
  // 1..100: p99 = 99.01
  std::vector<double> hundred(100);
  std::iota(hundred.begin(), hundred.end(), 1.0);
  EXPECT_NEAR(percentile(hundred, 99), 99.01, 1e-9);
  EXPECT_NEAR(percentile(hundred, 90), 90.1, 1e-9);
}

TEST(BenchServeStats, SummaryIsInMilliseconds) {
  const auto d = summarizeMs({0.001, 0.002, 0.003, 0.010});
  EXPECT_EQ(d.count, 4);
  EXPECT_DOUBLE_EQ(d.mean, 4.0);
  EXPECT_DOUBLE_EQ(d.p50, 2.5);
  EXPECT_DOUBLE_EQ(d.max, 10.0);
  EXPECT_EQ(summarizeMs({}).count, 0);
}

TEST(BenchServeStats, TpotExcludesTheFirstToken) {
  // 10 tokens: first at 100 ms, last at 1000 ms -> 900 ms over 9 gaps = 100 ms.
  EXPECT_NEAR(*tpotSeconds(okResult(0.1, 1.0, 10)), 0.1, 1e-12);
  EXPECT_FALSE(tpotSeconds(okResult(0.1, 0.1, 1)).has_value());
  auto failed = okResult(0.1, 1.0, 10);
  failed.ok = false;
  EXPECT_FALSE(tpotSeconds(failed).has_value());
}

TEST(BenchServeStats, MultiTokenChunksGivePerTokenItl) {
  std::vector<double> itl;
  appendItl(itl, 0.030, 3);  // one chunk of 3 tokens 30 ms after the previous one
  appendItl(itl, 0.020, 1);
  appendItl(itl, 0.010, 0);  // treated as one token
  ASSERT_EQ(itl.size(), 5u);
  EXPECT_NEAR(itl[0], 0.010, 1e-12);
  EXPECT_NEAR(itl[1], 0.010, 1e-12);
  EXPECT_NEAR(itl[2], 0.010, 1e-12);
  EXPECT_NEAR(itl[3], 0.020, 1e-12);
  EXPECT_NEAR(itl[4], 0.010, 1e-12);
}

TEST(BenchServeStats, LevelTotalsThroughputsGoodputAndErrors) {
  std::vector<RequestResult> rs;
  rs.push_back(okResult(0.050, 0.950, 10, 100));  // TPOT 100 ms
  rs.push_back(okResult(0.200, 0.650, 10, 100));  // TPOT 50 ms, TTFT over the SLO
  rs.push_back(okResult(0.080, 0.530, 10, 100));  // TPOT 50 ms: meets both
  rs.push_back(okResult(0.090, 0.090, 1, 100));   // one token: TPOT counts as 0 for goodput
  rs[0].itl_s = {0.1, 0.1};
  rs[2].itl_s = {0.05};
  RequestResult f1;
  f1.error = "HTTP 500: boom";
  f1.e2e_s = 0.01;
  RequestResult f2 = f1;
  RequestResult f3;
  f3.error = "stream ended before [DONE]";
  f3.e2e_s = 0.01;
  rs.push_back(f1);
  rs.push_back(f2);
  rs.push_back(f3);
  Slo slo;
  slo.ttft_ms = 100;
  slo.tpot_ms = 60;
  const auto s = summarize(rs, 2.0, slo);
  EXPECT_EQ(s.completed, 4);
  EXPECT_EQ(s.failed, 3);
  ASSERT_EQ(s.errors.size(), 2u);
  EXPECT_EQ(s.errors[0].message, "HTTP 500: boom");
  EXPECT_EQ(s.errors[0].count, 2);
  EXPECT_EQ(s.errors[1].count, 1);
  EXPECT_EQ(s.total_output_tokens, 31);
  EXPECT_EQ(s.total_input_tokens, 400);
  EXPECT_DOUBLE_EQ(s.output_throughput, 15.5);
  EXPECT_DOUBLE_EQ(s.total_token_throughput, 215.5);
  EXPECT_DOUBLE_EQ(s.request_throughput, 2.0);
  ASSERT_TRUE(s.request_goodput.has_value());
  EXPECT_DOUBLE_EQ(*s.request_goodput, 1.0);  // requests 3 and 4 of 2 s
  EXPECT_EQ(s.tpot_ms.count, 3);
  EXPECT_NEAR(s.tpot_ms.mean, (100.0 + 50.0 + 50.0) / 3, 1e-9);
  EXPECT_NEAR(s.tpot_ms.p50, 50.0, 1e-9);
  EXPECT_EQ(s.itl_ms.count, 3);
  EXPECT_NEAR(s.itl_ms.mean, 250.0 / 3, 1e-9);
  EXPECT_EQ(s.ttft_ms.count, 4);
  EXPECT_NEAR(s.ttft_ms.p50, 85.0, 1e-9);
  EXPECT_NEAR(s.mean_concurrency, (0.95 + 0.65 + 0.53 + 0.09 + 0.03) / 2.0, 1e-9);
  // No SLO: no goodput.
  EXPECT_FALSE(summarize(rs, 2.0, Slo{}).request_goodput.has_value());
}

TEST(BenchServeStats, MtpFromCounterDeltas) {
  // 100 drafts proposed, 80 accepted, 180 tokens: 100 sequence steps -> 0.8 accepted per step.
  const auto m = mtpFromDeltas(100.0, 80.0, 180.0, 40.0);
  ASSERT_TRUE(m.has_value());
  EXPECT_DOUBLE_EQ(*m->acceptance_rate, 0.8);
  EXPECT_DOUBLE_EQ(*m->accepted_tokens_per_step, 0.8);
  // MTP off: counters present but nothing proposed -> no acceptance rate, 0 accepted per step.
  const auto off = mtpFromDeltas(0.0, 0.0, 50.0, 50.0);
  ASSERT_TRUE(off.has_value());
  EXPECT_FALSE(off->acceptance_rate.has_value());
  EXPECT_DOUBLE_EQ(*off->accepted_tokens_per_step, 0.0);
  EXPECT_FALSE(mtpFromDeltas(std::nullopt, std::nullopt, std::nullopt, std::nullopt).has_value());
}

TEST(BenchServeArrivals, PoissonMeanRateAndSpreadForAFixedSeed) {
  const double rate = 10;
  const auto t = poissonArrivals(rate, 20000, 7);
  ASSERT_EQ(t.size(), 20000u);
  std::vector<double> gaps;
  double prev = 0;
  for (double x : t) {
    ASSERT_GT(x, prev);
    gaps.push_back(x - prev);
    prev = x;
  }
  const double mean = std::accumulate(gaps.begin(), gaps.end(), 0.0) / static_cast<double>(gaps.size());
  double var = 0;
  for (double g : gaps) var += (g - mean) * (g - mean);
  const double sd = std::sqrt(var / static_cast<double>(gaps.size()));
  EXPECT_NEAR(mean, 1 / rate, 0.03 / rate);  // the mean gap: 3 % of 0.1 s (sampling error ~0.7 %)
  EXPECT_NEAR(sd / mean, 1.0, 0.05);         // exponential gaps: coefficient of variation 1
  EXPECT_EQ(poissonArrivals(rate, 5, 7), poissonArrivals(rate, 5, 7));
  EXPECT_NE(poissonArrivals(rate, 5, 7), poissonArrivals(rate, 5, 8));
  EXPECT_TRUE(poissonArrivals(0, 5, 7).empty());
}

TEST(BenchServeWorkload, RandomCompletionsBodies) {
  WorkloadOptions o;
  o.model = "m";
  o.input_tokens = 32;
  o.output_tokens = 16;
  o.token_id_min = 500;
  o.token_id_max = 600;
  o.seed = 3;
  const auto reqs = randomRequests(o, 4);
  ASSERT_EQ(reqs.size(), 4u);
  EXPECT_EQ(reqs[3].body, randomRequests(o, 4)[3].body);  // deterministic for a seed
  EXPECT_NE(reqs[0].body, reqs[1].body);
  for (const auto& r : reqs) {
    EXPECT_EQ(r.prompt_tokens, 32);
    EXPECT_EQ(r.max_tokens, 16);
    const auto body = boost::json::parse(r.body).as_object();
    EXPECT_EQ(body.at("model").as_string(), "m");
    EXPECT_EQ(body.at("max_tokens").as_int64(), 16);
    EXPECT_TRUE(body.at("stream").as_bool());
    EXPECT_TRUE(body.at("ignore_eos").as_bool());
    EXPECT_TRUE(body.at("return_token_ids").as_bool());
    EXPECT_TRUE(body.at("stream_options").as_object().at("include_usage").as_bool());
    const auto& prompt = body.at("prompt").as_array();
    ASSERT_EQ(prompt.size(), 32u);
    for (const auto& id : prompt) {
      EXPECT_GE(id.as_int64(), 500);
      EXPECT_LT(id.as_int64(), 600);
    }
  }
  o.ignore_eos = false;
  o.return_token_ids = false;
  const auto plain = boost::json::parse(randomRequests(o, 1)[0].body).as_object();
  EXPECT_FALSE(plain.contains("ignore_eos"));
  EXPECT_FALSE(plain.contains("return_token_ids"));
}

TEST(BenchServeWorkload, RandomChatBodiesHaveTheWordCount) {
  WorkloadOptions o;
  o.model = "m";
  o.endpoint = Endpoint::Chat;
  o.input_tokens = 20;
  const auto body = boost::json::parse(randomRequests(o, 1)[0].body).as_object();
  const auto& messages = body.at("messages").as_array();
  ASSERT_EQ(messages.size(), 1u);
  const std::string text(messages[0].as_object().at("content").as_string());
  EXPECT_EQ(std::count(text.begin(), text.end(), ' '), 19);
  EXPECT_FALSE(body.contains("prompt"));
}

TEST(BenchServeWorkload, PromptFileLinesAndErrors) {
  WorkloadOptions o;
  o.model = "m";
  o.output_tokens = 9;
  auto ok = parsePromptLines("{\"prompt\": \"hello\"}\n\n{\"prompt\": [1, 2, 3], \"max_tokens\": 4}\n", "p.jsonl", o);
  ASSERT_TRUE(ok.ok()) << ok.error().toString();
  ASSERT_EQ(ok->size(), 2u);
  EXPECT_EQ((*ok)[0].max_tokens, 9);
  EXPECT_EQ((*ok)[1].max_tokens, 4);
  EXPECT_EQ((*ok)[1].prompt_tokens, 3);
  EXPECT_EQ(boost::json::parse((*ok)[0].body).as_object().at("prompt").as_string(), "hello");

  auto bad_json = parsePromptLines("{\"prompt\": \"a\"}\n{nope\n", "p.jsonl", o);
  ASSERT_FALSE(bad_json.ok());
  EXPECT_NE(bad_json.error().message.find("p.jsonl:2"), std::string::npos) << bad_json.error().message;
  auto messages_on_completions = parsePromptLines(R"({"messages": [{"role": "user", "content": "x"}]})", "f", o);
  ASSERT_FALSE(messages_on_completions.ok());
  EXPECT_NE(messages_on_completions.error().message.find("--endpoint chat"), std::string::npos);
  EXPECT_FALSE(parsePromptLines(R"({"prompt": "a", "max_tokens": 0})", "f", o).ok());
  EXPECT_FALSE(parsePromptLines(R"({"text": "a"})", "f", o).ok());
  EXPECT_FALSE(parsePromptLines("\n\n", "f", o).ok());
  EXPECT_FALSE(loadPromptFile("/nonexistent/prompts.jsonl", o).ok());

  o.endpoint = Endpoint::Chat;
  auto chat = parsePromptLines(R"({"prompt": "hi"})"
                               "\n"
                               R"({"messages": [{"role": "user", "content": "x"}]})",
                               "f", o);
  ASSERT_TRUE(chat.ok()) << chat.error().toString();
  EXPECT_EQ(boost::json::parse((*chat)[0].body).as_object().at("messages").as_array().size(), 1u);
}

TEST(BenchServeMetrics, PrometheusTextSumsLabelSets) {
  const auto m = parsePrometheusText(
      "# HELP x_total help\n# TYPE x_total counter\n"
      "x_total{a=\"1\"} 3\n"
      "x_total{a=\"odd } brace\",b=\"q\\\"\"} 4.5\n"
      "y 1e3 1700000000\n"
      "garbage\n"
      "z{unterminated=\"1\" 5\n"
      "nan_metric NaN\n");
  EXPECT_DOUBLE_EQ(m.at("x_total"), 7.5);
  EXPECT_DOUBLE_EQ(m.at("y"), 1000);
  EXPECT_FALSE(m.contains("garbage"));
  EXPECT_FALSE(m.contains("z"));
  EXPECT_FALSE(m.contains("nan_metric"));
  EXPECT_DOUBLE_EQ(m.at("x_total{a=\"1\"}"), 3);  // each label set also on its own
  EXPECT_DOUBLE_EQ(m.at("x_total{a=\"odd } brace\",b=\"q\\\"\"}"), 4.5);
}

TEST(BenchServeMetrics, PrefillTimesPerPromptFromHistogramDeltas) {
  const auto before = parsePrometheusText(
      "pdserve_prefill_compute_seconds_sum 1.0\npdserve_prefill_compute_seconds_count 10\n"
      "pdserve_prefill_queue_seconds_sum 0.5\npdserve_prefill_queue_seconds_count 10\n"
      "pdserve_prefill_transfer_seconds_sum 0.1\npdserve_prefill_transfer_seconds_count 10\n"
      "pdserve_kv_transfer_seconds_sum{side=\"send\"} 2\npdserve_kv_transfer_seconds_count{side=\"send\"} 10\n"
      "pdserve_kv_transfer_seconds_sum{side=\"receive\"} 50\npdserve_kv_transfer_seconds_count{side=\"receive\"} 9\n"
      "pdserve_kv_put_bytes_total 1000\n");
  const auto after = parsePrometheusText(
      "pdserve_prefill_compute_seconds_sum 1.6\npdserve_prefill_compute_seconds_count 14\n"
      "pdserve_prefill_queue_seconds_sum 0.9\npdserve_prefill_queue_seconds_count 14\n"
      "pdserve_prefill_transfer_seconds_sum 0.14\npdserve_prefill_transfer_seconds_count 14\n"
      "pdserve_kv_transfer_seconds_sum{side=\"send\"} 2.8\npdserve_kv_transfer_seconds_count{side=\"send\"} 14\n"
      "pdserve_kv_transfer_seconds_sum{side=\"receive\"} 90\npdserve_kv_transfer_seconds_count{side=\"receive\"} 13\n"
      "pdserve_kv_put_bytes_total 5000\n");
  const auto p = prefillFromDeltas(before, after);
  ASSERT_TRUE(p.has_value());
  EXPECT_DOUBLE_EQ(p->prompts, 4);
  EXPECT_NEAR(*p->compute_ms, 150.0, 1e-9);
  EXPECT_NEAR(*p->queue_ms, 100.0, 1e-9);
  EXPECT_NEAR(*p->kv_tail_ms, 10.0, 1e-9);
  EXPECT_NEAR(*p->kv_transfer_ms, 200.0, 1e-9);  // the send side only: the receive side is a decode worker's
  EXPECT_NEAR(*p->kv_bytes, 1000.0, 1e-9);
  EXPECT_FALSE(prefillFromDeltas(after, after).has_value());  // no prompt in between
  EXPECT_FALSE(prefillFromDeltas({}, parsePrometheusText("pdserve_decode_steps_total 3\n")).has_value());
}

TEST(BenchServeUrl, ParsesHostPortAndPrefix) {
  auto a = parseUrl("http://127.0.0.1:8000");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->host, "127.0.0.1");
  EXPECT_EQ(a->port, 8000);
  EXPECT_EQ(a->prefix, "");
  auto b = parseUrl("localhost:30000/v1/");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->host, "localhost");
  EXPECT_EQ(b->port, 30000);
  EXPECT_EQ(b->prefix, "");
  auto c = parseUrl("http://gw/proxy");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->port, 80);
  EXPECT_EQ(c->prefix, "/proxy");
  auto d = parseUrl("http://[::1]:9000");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->host, "::1");
  EXPECT_EQ(d->port, 9000);
  EXPECT_FALSE(parseUrl("https://x:1").ok());
  EXPECT_FALSE(parseUrl("http://x:0").ok());
  EXPECT_FALSE(parseUrl("http://x:99999").ok());
  EXPECT_FALSE(parseUrl("http://x:8a").ok());
  EXPECT_FALSE(parseUrl("http://:80").ok());
}

TEST(BenchServeReport, ProgressAndSummaryLines) {
  EXPECT_EQ(progressLine("c=1", 5, 10, 1, 12.3, false, 10),
            "c=1              [#####.....] 5/10 req  1 failed  12 tok/s");
  EXPECT_EQ(progressLine("c=1", 0, 10, 0, 0, true, 10), "c=1              warming up");
  LevelStats l;
  l.concurrency = 4;
  l.completed = 3;
  l.failed = 1;
  l.errors = {{"HTTP 503: busy", 1}};
  const auto line = levelSummaryLine(l);
  EXPECT_EQ(line.rfind("concurrency 4: 3 ok, 1 failed", 0), 0u) << line;
  EXPECT_NE(line.find("(first error: HTTP 503: busy)"), std::string::npos) << line;
  l.concurrency = 0;
  l.request_rate = 2.5;
  EXPECT_EQ(levelLabel(l), "rate 2.5/s");
}

TEST(BenchServeReport, XmlEscape) {
  EXPECT_EQ(xmlEscape("a<b>&\"c'\x01"), "a&lt;b&gt;&amp;&quot;c&apos; ");
}

TEST(BenchServeWorkload, PositiveNumberLists) {
  auto c = parsePositiveNumbers("1,2,64", "concurrency");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(*c, (std::vector<double>{1, 2, 64}));
  auto r = parsePositiveNumbers("0.5,2.5", "request-rate");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, (std::vector<double>{0.5, 2.5}));
  for (const char* bad : {"", "1,,2", "0", "-1", "2x", "nan", "inf"}) {
    auto e = parsePositiveNumbers(bad, "concurrency");
    ASSERT_FALSE(e.ok()) << bad;
    EXPECT_NE(e.error().message.find("--concurrency"), std::string::npos) << e.error().message;
  }
}

TEST(BenchServeMetrics, CounterDeltasCountAMissingBeforeAsZero) {
  const std::map<std::string, double> before{{"a", 10}, {"b", 1}};
  const std::map<std::string, double> after{{"a", 25}, {"c", 7}};
  EXPECT_EQ(counterDelta(before, after, "a"), 15.0);
  EXPECT_EQ(counterDelta(before, after, "c"), 7.0);
  EXPECT_EQ(counterDelta(before, after, "b"), std::nullopt) << "gone after: no delta";
}

TEST(BenchServeWorkload, ModelListGivesIdContextAndVocabulary) {
  auto m = parseModelList(
      R"({"object":"list","data":[{"id":"pdserve-default","max_model_len":1024,"vocab_size":4096},{"id":"b"}]})");
  ASSERT_TRUE(m.ok()) << m.error().toString();
  EXPECT_EQ(m->id, "pdserve-default");
  EXPECT_EQ(m->max_model_len, 1024);
  EXPECT_EQ(m->vocab_size, 4096);
  auto bare = parseModelList(R"({"data":[{"object":"model"},{"id":"vllm-model","max_model_len":"big"}]})");
  ASSERT_TRUE(bare.ok());
  EXPECT_EQ(bare->id, "vllm-model");
  EXPECT_EQ(bare->max_model_len, 0) << "not a number: not reported";
  EXPECT_EQ(bare->vocab_size, 0);
  EXPECT_FALSE(parseModelList(R"({"data":[]})").ok());
  EXPECT_FALSE(parseModelList("not json").ok());
}

TEST(BenchServeWorkload, FitsTokenIdsToTheVocabularyAndLengthsToTheContext) {
  WorkloadOptions w;
  w.token_id_min = 100;
  w.token_id_max = 30000;
  w.input_tokens = 128;
  w.output_tokens = 128;
  auto notes = fitWorkload(w, 4096, 1024);
  ASSERT_TRUE(notes.ok());
  EXPECT_EQ(w.token_id_max, 4096);
  EXPECT_EQ(w.token_id_min, 100);
  EXPECT_EQ(w.input_tokens, 128) << "fits: unchanged";
  EXPECT_EQ(w.output_tokens, 128);
  EXPECT_EQ(notes->size(), 1U);
  for (const auto& r : randomRequests(w, 8)) {
    const auto body = boost::json::parse(r.body);
    for (const auto& id : body.at("prompt").as_array()) {
      EXPECT_LT(id.to_number<std::int64_t>(), 4096);
      EXPECT_GE(id.to_number<std::int64_t>(), 100);
    }
  }

  // Output is shortened first, then the prompt; each keeps at least one token.
  w.input_tokens = 900;
  w.output_tokens = 500;
  ASSERT_TRUE(fitWorkload(w, 0, 1024).ok());
  EXPECT_EQ(w.input_tokens, 900);
  EXPECT_EQ(w.output_tokens, 124);
  w.input_tokens = 5000;
  w.output_tokens = 10;
  ASSERT_TRUE(fitWorkload(w, 0, 1024).ok());
  EXPECT_EQ(w.input_tokens, 1023);
  EXPECT_EQ(w.output_tokens, 1);

  // A vocabulary below token_id_min starts the ids at 0; a context of 1 has no room.
  w.token_id_min = 100;
  w.token_id_max = 30000;
  ASSERT_TRUE(fitWorkload(w, 50, 0).ok());
  EXPECT_EQ(w.token_id_min, 0);
  EXPECT_EQ(w.token_id_max, 50);
  EXPECT_FALSE(fitWorkload(w, 0, 1).ok());
  // Nothing reported: nothing changes.
  const WorkloadOptions before = w;
  auto none = fitWorkload(w, 0, 0);
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());
  EXPECT_EQ(w.token_id_max, before.token_id_max);
  EXPECT_EQ(w.input_tokens, before.input_tokens);
}

}  // namespace
}  // namespace pd::bench
