#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "pd/common/metrics.h"

namespace {

using pd::metrics::Registry;

TEST(Metrics, CounterWithLabelsRendersExactText) {
  Registry r;
  auto& requests = r.counter("pd_requests_total", "Requests by status.", {"endpoint", "status"});
  requests.labels({"/v1/completions", "200"}).inc();
  requests.labels({"/v1/completions", "200"}).inc(2);
  requests.labels({"/v1/chat/completions", "400"}).inc();
  EXPECT_EQ(r.render(),
            "# HELP pd_requests_total Requests by status.\n"
            "# TYPE pd_requests_total counter\n"
            "pd_requests_total{endpoint=\"/v1/chat/completions\",status=\"400\"} 1\n"
            "pd_requests_total{endpoint=\"/v1/completions\",status=\"200\"} 3\n");
}

TEST(Metrics, EscapesLabelValuesAndHelp) {
  Registry r;
  r.gauge("pd_weird", "Help with \\ and\nnewline.", {"v"}).labels({"a\"b\\c\nd"}).set(-2.5);
  EXPECT_EQ(r.render(),
            "# HELP pd_weird Help with \\\\ and\\nnewline.\n"
            "# TYPE pd_weird gauge\n"
            "pd_weird{v=\"a\\\"b\\\\c\\nd\"} -2.5\n");
}

TEST(Metrics, UnlabelledMetricsRenderZeroFromRegistration) {
  Registry r;
  r.counter("pd_b_total", "B.");
  r.gauge("pd_a", "A.");
  EXPECT_EQ(r.render(),
            "# HELP pd_a A.\n# TYPE pd_a gauge\npd_a 0\n"
            "# HELP pd_b_total B.\n# TYPE pd_b_total counter\npd_b_total 0\n");
}

TEST(Metrics, HistogramBucketsAreCumulativeAndInclusive) {
  Registry r;
  auto& h = r.histogram("pd_latency_seconds", "Latency.", {0.1, 0.5, 1}, {"leg"});
  auto& p = h.labels({"prefill"});
  for (double v : {0.05, 0.1, 0.7, 3.0}) p.observe(v);
  EXPECT_EQ(r.render(),
            "# HELP pd_latency_seconds Latency.\n"
            "# TYPE pd_latency_seconds histogram\n"
            "pd_latency_seconds_bucket{leg=\"prefill\",le=\"0.1\"} 2\n"
            "pd_latency_seconds_bucket{leg=\"prefill\",le=\"0.5\"} 2\n"
            "pd_latency_seconds_bucket{leg=\"prefill\",le=\"1\"} 3\n"
            "pd_latency_seconds_bucket{leg=\"prefill\",le=\"+Inf\"} 4\n"
            "pd_latency_seconds_sum{leg=\"prefill\"} 3.85\n"
            "pd_latency_seconds_count{leg=\"prefill\"} 4\n");
}

TEST(Metrics, UnlabelledHistogram) {
  Registry r;
  r.histogram("pd_h", "H.", {1}).get().observe(0.5);
  EXPECT_EQ(r.render(),
            "# HELP pd_h H.\n# TYPE pd_h histogram\n"
            "pd_h_bucket{le=\"1\"} 1\npd_h_bucket{le=\"+Inf\"} 1\npd_h_sum 0.5\npd_h_count 1\n");
}

TEST(Metrics, FormatsSpecialValues) {
  EXPECT_EQ(pd::metrics::formatValue(1.0), "1");
  EXPECT_EQ(pd::metrics::formatValue(0.25), "0.25");
  EXPECT_EQ(pd::metrics::formatValue(1e21), "1e+21");
  EXPECT_EQ(pd::metrics::formatValue(std::numeric_limits<double>::infinity()), "+Inf");
  EXPECT_EQ(pd::metrics::formatValue(-std::numeric_limits<double>::infinity()), "-Inf");
  EXPECT_EQ(pd::metrics::formatValue(std::nan("")), "NaN");
}

TEST(Metrics, SameNameSharesTheFamily) {
  Registry r;
  auto& a = r.counter("pd_retries_total", "Retries.");
  auto& b = r.counter("pd_retries_total", "Retries.");
  EXPECT_EQ(&a, &b);
  a.get().inc();
  EXPECT_EQ(b.get().value(), 1.0);
}

TEST(Metrics, ConcurrentUpdatesAreExact) {
  Registry r;
  auto& c = r.counter("pd_c_total", "C.", {"t"});
  auto& g = r.gauge("pd_g", "G.");
  auto& h = r.histogram("pd_h", "H.", {0.5});
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      auto& mine = c.labels({t % 2 == 0 ? "even" : "odd"});
      for (int i = 0; i < 10000; ++i) {
        mine.inc();
        g.get().inc();
        g.get().dec();
        h.get().observe(i % 2 == 0 ? 0.25 : 1.0);
        if (i % 1000 == 0) (void)r.render();
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(c.labels({"even"}).value(), 40000.0);
  EXPECT_EQ(c.labels({"odd"}).value(), 40000.0);
  EXPECT_EQ(g.get().value(), 0.0);
  const auto s = h.get().snapshot();
  EXPECT_EQ(s.count, 80000u);
  EXPECT_EQ(s.cumulative[0], 40000u);
}

TEST(MetricsDeathTest, MisuseIsABug) {
  EXPECT_DEATH(
      {
        Registry r;
        r.counter("pd_x", "X.");
        r.gauge("pd_x", "X.");
      },
      "another type");
  EXPECT_DEATH({ Registry().counter("bad name", "X."); }, "invalid metric name");
  EXPECT_DEATH({ Registry().counter("pd_y", "Y.", {"a"}).labels({}); }, "label value count");
  EXPECT_DEATH({ Registry().counter("pd_z", "Z.").get().inc(-1); }, "only goes up");
}

}  // namespace
