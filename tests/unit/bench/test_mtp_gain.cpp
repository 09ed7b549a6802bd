// bench decode's MTP arithmetic (mtp_gain.h) on hand-computed runs.
#include <gtest/gtest.h>

#include "bench/decode/mtp_gain.h"

namespace pd::bench {
namespace {

TEST(MtpGain, SpeedupCostAndIdealOfAHandComputedPair) {
  // Plain: 100 steps, 100 tokens in 1 s, forward 0.8 s (8 ms per step).
  const StepTotals plain{100, 100, 1.0, 0.8, 0.0, 0, 0};
  // Speculative: 60 steps emit 100 tokens in 0.75 s; forward 0.6 s + MTP 0.12 s = 12 ms per step;
  // 48 of 60 drafts accepted.
  const StepTotals spec{60, 100, 0.75, 0.6, 0.12, 60, 48};
  const MtpGain g = mtpGain(plain, spec);
  EXPECT_DOUBLE_EQ(g.accepted_per_step, 0.8);
  EXPECT_DOUBLE_EQ(g.relative_cost, 0.5);                        // 12 ms / 8 ms - 1
  EXPECT_NEAR(g.measured_speedup, 100.0 / 0.75 / 100.0, 1e-12);  // 1.333x
  EXPECT_NEAR(g.ideal_speedup, 1.8 / 1.5, 1e-12);                // 1.2x
  EXPECT_NEAR(g.over_ideal, (100.0 / 75.0) / 1.2, 1e-12);
  EXPECT_DOUBLE_EQ(acceptanceRate(spec), 0.8);
}

TEST(MtpGain, EmptyRunsGiveZerosNotInfinities) {
  const StepTotals none{};
  const StepTotals plain{10, 10, 1.0, 0.5, 0.0, 0, 0};
  const MtpGain g = mtpGain(none, plain);
  EXPECT_DOUBLE_EQ(g.ideal_speedup, 0);
  EXPECT_DOUBLE_EQ(g.measured_speedup, 0);
  EXPECT_DOUBLE_EQ(acceptanceRate(plain), 0) << "no drafts proposed";
}

TEST(MtpGain, DecodeMbuIsBytesPerSecondOverTheCeiling) {
  EXPECT_DOUBLE_EQ(decodeMbu(5e6, 0.001, 10e9), 0.5);
  EXPECT_DOUBLE_EQ(decodeMbu(5e6, 0.0, 10e9), 0);
  EXPECT_DOUBLE_EQ(decodeMbu(5e6, 0.001, 0), 0);
}

}  // namespace
}  // namespace pd::bench
