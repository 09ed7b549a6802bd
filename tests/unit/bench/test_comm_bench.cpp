// bench comm's arithmetic (comm_bench.h): latency summaries, ucx_perftest's CSV, the ratio to
// the ceiling and the reports with and without a ceiling.
#include <gtest/gtest.h>

#include <boost/json.hpp>
#include <numeric>

#include "bench/comm/comm_bench.h"

namespace pd::bench {
namespace {

TEST(CommBench, SummaryIsMedianMeanAndP99) {
  std::vector<double> us(100);
  std::iota(us.begin(), us.end(), 1.0);  // 1..100, shuffled order does not matter
  std::swap(us[0], us[99]);
  const LatencySummary s = summarizeLatencies(us);
  EXPECT_DOUBLE_EQ(s.median_us, 51);
  EXPECT_DOUBLE_EQ(s.mean_us, 50.5);
  EXPECT_DOUBLE_EQ(s.p99_us, 100);
  const LatencySummary none = summarizeLatencies({});
  EXPECT_DOUBLE_EQ(none.median_us, 0);
}

TEST(CommBench, ReadsTheMedianFromPerftestsLastCsvLine) {
  EXPECT_EQ(parsePerftestLatency("+---\n| warmup\n1000,0.512,0.600,0.610,1.0\n5000,0.498,0.590,0.600,1.0\n\n"), 0.498);
  EXPECT_EQ(parsePerftestLatency("5000,2.5,3"), 2.5);
  EXPECT_EQ(parsePerftestLatency(""), std::nullopt);
  EXPECT_EQ(parsePerftestLatency("error: no transport\n"), std::nullopt);
  EXPECT_EQ(parsePerftestLatency("5000,0,0\n"), std::nullopt) << "a zero latency is no measurement";
}

TEST(CommBench, RatioIsOursOverTheCeilingAndReportsSayNaWithoutOne) {
  CommRow row;
  row.floats = 7168;
  row.ours = {3.0, 3.5, 9.0};
  row.perftest_sm_us = 1.5;
  EXPECT_EQ(ratioToCeiling(row.ours, row.perftest_sm_us), 2.0);
  EXPECT_EQ(ratioToCeiling(row.ours, std::nullopt), std::nullopt);
  const auto doc = boost::json::parse(commReportJson(CommBenchConfig{}, {row})).as_object();
  const auto& c = doc.at("cases").as_array().at(0).as_object();
  EXPECT_EQ(c.at("bytes").as_int64(), 7168 * 4);
  EXPECT_DOUBLE_EQ(c.at("ratio_to_ucx_perftest_sm").as_double(), 2.0);
  EXPECT_TRUE(c.at("ucx_perftest_am_lat_tcp_us").is_null());
  EXPECT_FALSE(c.contains("ratio_to_ucx_perftest_tcp"));
  const std::string text = commReportText({row});
  EXPECT_NE(text.find("| 1.50         n/a          | 2.00       n/a"), std::string::npos) << text;
}

}  // namespace
}  // namespace pd::bench
