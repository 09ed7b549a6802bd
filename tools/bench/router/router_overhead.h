#pragma once
/// The arithmetic of `pdserve bench router`: what the router adds to a request's latency is the
/// difference of the latency percentiles of the same requests through the router and sent
/// straight to the workers' internal API, at each concurrency. The run itself (child processes,
/// the two ways of sending) is router_bench.h's.
///
/// Thread rules: pure functions.

#include <vector>

namespace pd::bench {

/// The sample at rank round(p * (n - 1)) of the sorted samples (p in [0, 1]); 0 for none.
[[nodiscard]] double nearestRankPercentile(std::vector<double> samples, double p);

/// Latency percentiles of one concurrency level, microseconds.
struct RouterOverhead {
  double router_p50_us = 0;
  double router_p99_us = 0;
  double direct_p50_us = 0;
  double direct_p99_us = 0;
  double overhead_p50_us = 0;  ///< router_p50_us - direct_p50_us
  double overhead_p99_us = 0;  ///< router_p99_us - direct_p99_us
};

/// The percentiles of both ways and their differences.
[[nodiscard]] RouterOverhead routerOverhead(const std::vector<double>& via_router_us,
                                            const std::vector<double>& direct_us);

}  // namespace pd::bench
