// bench engine's arithmetic (engine_bench.h): MBU against the measured bandwidth, medians, the
// batch-1 headline and the prefill FLOP fraction, and both reports.
#include <gtest/gtest.h>

#include <boost/json.hpp>

#include "bench/engine/engine_bench.h"

namespace pd::bench {
namespace {

EngineBenchResult sample() {
  EngineBenchResult r;
  r.model = "/m";
  r.weight_dtype = "BF16";
  r.backend = "cpu/avx2";
  r.threads = 4;
  r.read_bandwidth = 20e9;
  r.peak_flops = 100e9;
  r.context = 256;
  r.decode = {{4, 0.9, 0.002, 10e6, memoryBandwidthUtilization(10e6, 0.002, 20e9), 12},
              {1, 0.8, 0.001, 4e6, memoryBandwidthUtilization(4e6, 0.001, 20e9), 8}};
  r.prefill_tokens = 512;
  r.prefill_seconds = 0.5;
  r.prefill_flops = 10e9;
  r.prefill_cpu_share = 0.95;
  return r;
}

TEST(EngineBench, MbuIsBytesPerSecondOverTheCeiling) {
  EXPECT_DOUBLE_EQ(memoryBandwidthUtilization(4e6, 0.001, 20e9), 0.2);  // 4 GB/s of 20
  EXPECT_DOUBLE_EQ(memoryBandwidthUtilization(4e6, 0, 20e9), 0) << "no time: no ratio";
  EXPECT_DOUBLE_EQ(memoryBandwidthUtilization(4e6, 0.001, 0), 0) << "no ceiling: no ratio";
  EXPECT_DOUBLE_EQ(medianSeconds({0.3, 0.1, 0.2}), 0.2);
  EXPECT_DOUBLE_EQ(medianSeconds({}), 0);
}

TEST(EngineBench, HeadlinesAreBatchOneMbuAndThePrefillFraction) {
  const EngineBenchResult r = sample();
  EXPECT_DOUBLE_EQ(batchOneMbu(r), 0.2);
  EXPECT_DOUBLE_EQ(prefillFlopsFraction(r), 0.2);  // 20 GFLOP/s of 100
  EngineBenchResult none;
  EXPECT_DOUBLE_EQ(batchOneMbu(none), 0);
  EXPECT_DOUBLE_EQ(prefillFlopsFraction(none), 0);
}

TEST(EngineBench, ReportsCarryTheRatios) {
  const EngineBenchResult r = sample();
  const auto doc = boost::json::parse(engineReportJson(r)).as_object();
  EXPECT_DOUBLE_EQ(doc.at("mbu_batch1").to_number<double>(), 0.2);
  EXPECT_DOUBLE_EQ(doc.at("prefill_flops_fraction").to_number<double>(), 0.2);
  EXPECT_DOUBLE_EQ(doc.at("read_bandwidth_gbs").to_number<double>(), 20);
  ASSERT_EQ(doc.at("decode").as_array().size(), 2U);
  EXPECT_DOUBLE_EQ(doc.at("decode").as_array()[0].at("tokens_per_s").to_number<double>(), 2000);
  const std::string text = engineReportText(r);
  EXPECT_NE(text.find("MBU 0.200"), std::string::npos) << text;
  EXPECT_NE(text.find("fraction of peak 0.200"), std::string::npos) << text;
  EXPECT_FALSE(doc.at("batch_invariant").as_bool());
  EXPECT_EQ(text.find("batch-invariant"), std::string::npos) << text;
  EngineBenchResult invariant = r;
  invariant.batch_invariant = true;
  EXPECT_TRUE(boost::json::parse(engineReportJson(invariant)).at("batch_invariant").as_bool());
  EXPECT_NE(engineReportText(invariant).find("cpu/avx2 batch-invariant"), std::string::npos)
      << engineReportText(invariant);
}

}  // namespace
}  // namespace pd::bench
