// bench kv's arithmetic (kv_bench.h): payload bytes and put counts, medians of runs, the ratio to
// the ucx_perftest ceiling per case and over cases, and the reports; and the shared ucx_perftest
// CSV reader (bench_util.h).
#include <gtest/gtest.h>

#include <boost/json.hpp>

#include "bench/common/bench_util.h"
#include "bench/kv/kv_bench.h"

namespace pd::bench {
namespace {

TEST(KvBench, BytesAndPutsOfAPrompt) {
  // DeepSeek-V3: 61 layers x 576 BF16 values (1152 bytes) per token, blocks of 64 tokens.
  EXPECT_EQ(kvPayloadBytes(1024, 61, 1152), 1024ULL * 61 * 1152);
  EXPECT_EQ(kvPutCount(1024, 64, 61), 16U * 61);
  EXPECT_EQ(kvPutCount(1000, 64, 61), 16U * 61) << "a partial block is one more put";
  EXPECT_EQ(kvPutCount(1, 64, 2), 2U);
}

TEST(KvBench, MediansAndRatios) {
  EXPECT_DOUBLE_EQ(medianOfRuns({3, 1, 2}), 2);
  EXPECT_DOUBLE_EQ(medianOfRuns({4, 1, 3, 2}), 2.5) << "mean of the middle two";
  EXPECT_DOUBLE_EQ(medianOfRuns({}), 0);
  KvCase a;
  a.ours_bps = {1e9, 2e9, 3e9};
  a.perftest_bps = {4e9, 4e9, 5e9};
  EXPECT_DOUBLE_EQ(a.ratio(), 0.5);
  KvCase no_ceiling;
  no_ceiling.ours_bps = {1e9};
  EXPECT_DOUBLE_EQ(no_ceiling.ratio(), 0);
  KvBenchResult r;
  KvCase b = a;
  b.ours_bps = {4e9};
  r.cases = {a, b};
  EXPECT_DOUBLE_EQ(r.overallRatio(), (0.5 + 1.0) / 2);
}

TEST(KvBench, TokenListsAndReports) {
  auto t = parseKvTokenList("1024,4096");
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(*t, (std::vector<std::uint32_t>{1024, 4096}));
  EXPECT_FALSE(parseKvTokenList("0").ok());
  EXPECT_FALSE(parseKvTokenList("1024,").ok());
  KvBenchConfig cfg;
  KvBenchResult r;
  r.ucx_tls = "tcp,sm";
  r.data_path = "rma";
  r.put_bytes = 64 * 1152;
  KvCase c;
  c.tokens = 1024;
  c.bytes = kvPayloadBytes(1024, 61, 1152);
  c.puts = kvPutCount(1024, 64, 61);
  c.ours_s = {0.1};
  c.ours_bps = {1e9};
  c.perftest_bps = {2e9};
  r.cases = {c};
  const auto doc = boost::json::parse(kvReportJson(cfg, r)).as_object();
  EXPECT_DOUBLE_EQ(doc.at("ratio_to_ucx_perftest").as_double(), 0.5);
  EXPECT_EQ(doc.at("cases").as_array().at(0).at("puts").to_number<std::uint64_t>(), 976U);
  EXPECT_NE(kvReportText(cfg, r).find("ratio_to_ucx_perftest (median over cases): 0.500"), std::string::npos);
}

TEST(BenchUtil, LastCsvRowOfPerftestOutput) {
  EXPECT_EQ(lastCsvRow("header\n100,1.5,2.5,3,4,5,6,7\n\n"),
            (std::vector<std::string>{"100", "1.5", "2.5", "3", "4", "5", "6", "7"}));
  EXPECT_EQ(lastCsvRow("only"), (std::vector<std::string>{"only"}));
  EXPECT_TRUE(lastCsvRow("\n \n").empty());
}

}  // namespace
}  // namespace pd::bench
