// bench decode's pure parts (decode_bench.h): a run's median and totals, MTP rows and their
// JSON, the sweep rows' JSON, sysfs cache sizes.
#include <gtest/gtest.h>

#include <boost/json.hpp>

#include "bench/decode/decode_bench.h"

namespace pd::bench {
namespace {

DecodeRun runOf(std::int64_t steps, std::int64_t tokens, double wall, double forward, double mtp, std::int64_t proposed,
                std::int64_t accepted) {
  DecodeRun r;
  r.batch = 1;
  r.steps = steps;
  r.tokens = tokens;
  r.wall_seconds = wall;
  r.forward_seconds = forward;
  r.mtp_seconds = mtp;
  r.drafts_proposed = proposed;
  r.drafts_accepted = accepted;
  return r;
}

TEST(DecodeBench, MedianStepIsTheUpperMiddleOfTheTimedSteps) {
  DecodeRun r;
  EXPECT_DOUBLE_EQ(r.medianStep(), 0) << "no steps";
  r.step_seconds = {0.3, 0.1, 0.2};
  EXPECT_DOUBLE_EQ(r.medianStep(), 0.2);
  r.step_seconds = {0.4, 0.1, 0.3, 0.2};
  EXPECT_DOUBLE_EQ(r.medianStep(), 0.3);
}

TEST(DecodeBench, MtpRowCarriesTheGainOfTheRunOverThePlainOne) {
  // The hand-computed pair of test_mtp_gain.cpp: 1.333x measured, 1.2x ideal.
  const DecodeRun plain = runOf(100, 100, 1.0, 0.8, 0.0, 0, 0);
  const MtpRow row = mtpRow(plain, runOf(60, 100, 0.75, 0.6, 0.12, 60, 48), 1, 0.85);
  EXPECT_EQ(row.k, 1);
  EXPECT_DOUBLE_EQ(row.p, 0.85);
  EXPECT_DOUBLE_EQ(row.acceptance(), 0.8);
  EXPECT_NEAR(row.tokensPerSecond(), 100 / 0.75, 1e-9);
  EXPECT_NEAR(row.gain.ideal_speedup, 1.2, 1e-12);
  EXPECT_NEAR(row.gain.measured_speedup, 100 / 75.0, 1e-12);

  const auto json = boost::json::parse(mtpRowJson(row)).as_object();
  EXPECT_DOUBLE_EQ(json.at("p").to_number<double>(), 0.85);
  EXPECT_EQ(json.at("steps").as_int64(), 60);
  EXPECT_DOUBLE_EQ(json.at("acceptance_rate").to_number<double>(), 0.8);
  EXPECT_DOUBLE_EQ(json.at("ideal_speedup").to_number<double>(), 1.2);
}

TEST(DecodeBench, RowsOfTheModelsOwnDraftsHaveNoP) {
  const DecodeRun plain = runOf(10, 10, 1.0, 0.5, 0.0, 0, 0);
  const MtpRow row = mtpRow(plain, runOf(8, 10, 0.9, 0.5, 0.1, 8, 2), 1, -1.0);
  const auto json = boost::json::parse(mtpRowJson(row)).as_object();
  EXPECT_FALSE(json.contains("p"));
  EXPECT_DOUBLE_EQ(json.at("acceptance_rate").to_number<double>(), 0.25);
}

TEST(DecodeBench, SweepRowIsPerStepBytesOverTheMedianAgainstTheCeiling) {
  DecodeRun r = runOf(4, 16, 0.008, 0.006, 0.0, 0, 0);
  r.batch = 4;
  r.step_seconds = {0.002, 0.002, 0.002, 0.002};
  r.bytes = 4 * 10e6;  // 10 MB per step
  r.experts = 40;
  const auto json = boost::json::parse(decodeRowJson(r, 10e9)).as_object();
  EXPECT_EQ(json.at("batch").as_int64(), 4);
  EXPECT_DOUBLE_EQ(json.at("step_ms").to_number<double>(), 2.0);
  EXPECT_DOUBLE_EQ(json.at("tokens_per_s").to_number<double>(), 2000.0);
  EXPECT_DOUBLE_EQ(json.at("gbs").to_number<double>(), 5.0);
  EXPECT_DOUBLE_EQ(json.at("mbu").to_number<double>(), 0.5);
  EXPECT_DOUBLE_EQ(json.at("experts_per_step").to_number<double>(), 10.0);
  EXPECT_DOUBLE_EQ(json.at("forward_share").to_number<double>(), 0.75);
}

TEST(DecodeBench, CacheSizesOfSysfs) {
  EXPECT_EQ(parseCacheSize("32768K"), 32768ULL << 10);
  EXPECT_EQ(parseCacheSize("32k"), 32ULL << 10);
  EXPECT_EQ(parseCacheSize("2M"), 2ULL << 20);
  EXPECT_EQ(parseCacheSize("512"), 512U);
  EXPECT_EQ(parseCacheSize("K"), 0U);
}

}  // namespace
}  // namespace pd::bench
