// bench router's arithmetic (router_overhead.h): nearest-rank percentiles and the overhead as
// the difference of the two ways' percentiles.
#include <gtest/gtest.h>

#include <numeric>

#include "bench/router/router_overhead.h"

namespace pd::bench {
namespace {

TEST(RouterOverhead, NearestRankPercentiles) {
  std::vector<double> v(101);
  std::iota(v.begin(), v.end(), 0.0);  // 0..100
  std::reverse(v.begin(), v.end());
  EXPECT_DOUBLE_EQ(nearestRankPercentile(v, 0.5), 50);
  EXPECT_DOUBLE_EQ(nearestRankPercentile(v, 0.99), 99);
  EXPECT_DOUBLE_EQ(nearestRankPercentile(v, 1.0), 100);
  EXPECT_DOUBLE_EQ(nearestRankPercentile({7}, 0.99), 7);
  EXPECT_DOUBLE_EQ(nearestRankPercentile({}, 0.5), 0);
  EXPECT_DOUBLE_EQ(nearestRankPercentile({1, 2}, 0.5), 2) << "rank 0.5 rounds up";
}

TEST(RouterOverhead, IsTheDifferenceOfThePercentiles) {
  std::vector<double> direct(100);
  std::iota(direct.begin(), direct.end(), 1000.0);  // 1000..1099 us
  std::vector<double> via = direct;
  for (auto& x : via) x += 80;  // the router adds 80 us to every request
  via.back() += 1000;           // and one slow outlier beyond p99's rank
  const RouterOverhead o = routerOverhead(via, direct);
  EXPECT_DOUBLE_EQ(o.direct_p50_us, 1050);
  EXPECT_DOUBLE_EQ(o.router_p50_us, 1130);
  EXPECT_DOUBLE_EQ(o.overhead_p50_us, 80);
  EXPECT_DOUBLE_EQ(o.overhead_p99_us, 80);
}

}  // namespace
}  // namespace pd::bench
