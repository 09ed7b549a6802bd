// bench router's option checks and metrics reading (router_bench.h).
#include <gtest/gtest.h>

#include "bench/router/router_bench.h"

namespace pd::bench {
namespace {

TEST(RouterBench, ConcurrencyLevelsAreIntegersFromOneTo1024) {
  auto levels = parseConcurrencyLevels("1,64");
  ASSERT_TRUE(levels.ok()) << levels.error().toString();
  EXPECT_EQ(*levels, (std::vector<std::int64_t>{1, 64}));
  EXPECT_TRUE(parseConcurrencyLevels("1024").ok());
  for (const char* bad : {"1,x", "0", "1025", "-3", ","}) {
    auto r = parseConcurrencyLevels(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.error().code, ErrorCode::InvalidArgument) << bad;
  }
  EXPECT_NE(parseConcurrencyLevels("a").error().message.find("bench_router.concurrency"), std::string::npos);
}

TEST(RouterBench, GaugeValueReadsTheUnlabelledSample) {
  const std::string text =
      "# HELP pdserve_router_requests_in_flight Requests in flight\n"
      "# TYPE pdserve_router_requests_in_flight gauge\n"
      "pdserve_router_requests_in_flight_total 9\n"
      "pdserve_router_requests_in_flight 37\n";
  EXPECT_EQ(gaugeValue(text, "pdserve_router_requests_in_flight"), 37);
  EXPECT_EQ(gaugeValue("pdserve_router_requests_in_flight 3\n", "pdserve_router_requests_in_flight"), 3)
      << "the first line";
  EXPECT_EQ(gaugeValue(text, "pdserve_router_missing"), -1);
  EXPECT_EQ(gaugeValue("g nan-ish\n", "g"), -1) << "not a number";
}

}  // namespace
}  // namespace pd::bench
