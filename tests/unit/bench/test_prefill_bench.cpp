// bench prefill's arithmetic (prefill_bench.h): lengths fitted to the model's context, medians,
// overheads against the compute-alone ceiling, the headline row, and the report.
#include <gtest/gtest.h>

#include <boost/json.hpp>

#include "bench/prefill/prefill_bench.h"

namespace pd::bench {
namespace {

TEST(PrefillBench, ParsesLengths) {
  auto l = parsePrefillLengths("512,2048");
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(*l, (std::vector<std::int64_t>{512, 2048}));
  EXPECT_FALSE(parsePrefillLengths("512,,2048").ok());
  EXPECT_FALSE(parsePrefillLengths("0").ok());
  EXPECT_FALSE(parsePrefillLengths("12x").ok());
}

TEST(PrefillBench, DefaultLengthsAreCutAtTheContextWhichIsMeasuredInstead) {
  auto tiny = fitPrefillLengths({}, 1024);  // the embedded default model
  ASSERT_TRUE(tiny.ok());
  EXPECT_EQ(*tiny, (std::vector<std::int64_t>{512, 1024}));
  auto big = fitPrefillLengths({}, 163840);  // DeepSeek-V3
  ASSERT_TRUE(big.ok());
  EXPECT_EQ(*big, (std::vector<std::int64_t>{512, 2048, 8192}));
  auto exact = fitPrefillLengths({}, 4096);
  ASSERT_TRUE(exact.ok());
  EXPECT_EQ(*exact, (std::vector<std::int64_t>{512, 2048, 4096}));
  auto two_k = fitPrefillLengths({}, 2048);
  ASSERT_TRUE(two_k.ok());
  EXPECT_EQ(*two_k, (std::vector<std::int64_t>{512, 2048})) << "the context once";
  auto small = fitPrefillLengths({}, 100);
  ASSERT_TRUE(small.ok());
  EXPECT_EQ(*small, (std::vector<std::int64_t>{100}));
}

TEST(PrefillBench, GivenLengthsMustFitTheContext) {
  auto ok = fitPrefillLengths({64, 1024}, 1024);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(*ok, (std::vector<std::int64_t>{64, 1024}));
  auto bad = fitPrefillLengths({64, 2048}, 1024);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().code, ErrorCode::InvalidArgument);
  EXPECT_NE(bad.error().message.find("2048"), std::string::npos);
}

TEST(PrefillBench, MediansOverheadsAndTheHeadline) {
  EXPECT_DOUBLE_EQ(medianOf({3, 1, 2}), 2);
  EXPECT_DOUBLE_EQ(medianOf({4, 1, 3, 2}), 3) << "upper middle";
  EXPECT_DOUBLE_EQ(medianOf({}), 0);
  EXPECT_DOUBLE_EQ(overheadRatio({1.1, 1.2, 1.3}, {1.0, 0.9, 1.1}), 0.2);
  std::vector<PrefillRow> rows{{512, {1}, {1}, {1}}, {1024, {2}, {2}, {2}}, {8192, {3}, {3}, {3}}};
  EXPECT_EQ(headlineRow(rows).tokens, 1024) << "nearest to 2048";
  rows.push_back({2048, {4}, {5}, {6}});
  EXPECT_EQ(headlineRow(rows).tokens, 2048);
}

TEST(PrefillBench, ReportHasTheHeadlineRatios) {
  PrefillBenchConfig cfg;
  cfg.model = "/m";
  cfg.runs = 2;
  PrefillBenchResult result;
  result.threads = 4;
  result.rows = {{512, {1.0, 1.0}, {1.1, 1.1}, {1.5, 1.5}}, {1024, {2.0, 2.0}, {2.5, 2.5}, {4.0, 4.0}}};
  const auto doc = boost::json::parse(prefillReportJson(cfg, result)).as_object();
  EXPECT_EQ(doc.at("headline_tokens").as_int64(), 1024);
  EXPECT_DOUBLE_EQ(doc.at("streaming_overhead").as_double(), 0.25);
  EXPECT_DOUBLE_EQ(doc.at("send_after_overhead").as_double(), 1.0);
  EXPECT_DOUBLE_EQ(doc.at("streaming_vs_send_after").as_double(), 2.5 / 4.0);
  EXPECT_EQ(doc.at("cases").as_array().size(), 2U);
  const std::string table = prefillReportTable(result);
  EXPECT_NE(table.find("streaming_overhead (1024 tokens): 0.250"), std::string::npos) << table;
}

}  // namespace
}  // namespace pd::bench
