// The router-overhead arithmetic of bench router (router_overhead.h).
#include "bench/router/router_overhead.h"

#include <algorithm>
#include <cmath>
#include <cstddef>

namespace pd::bench {

double nearestRankPercentile(std::vector<double> v, double p) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const auto idx = static_cast<std::size_t>(std::lround(p * static_cast<double>(v.size() - 1)));
  return v[std::min(idx, v.size() - 1)];
}

RouterOverhead routerOverhead(const std::vector<double>& via_router_us, const std::vector<double>& direct_us) {
  RouterOverhead o;
  o.router_p50_us = nearestRankPercentile(via_router_us, 0.5);
  o.router_p99_us = nearestRankPercentile(via_router_us, 0.99);
  o.direct_p50_us = nearestRankPercentile(direct_us, 0.5);
  o.direct_p99_us = nearestRankPercentile(direct_us, 0.99);
  o.overhead_p50_us = o.router_p50_us - o.direct_p50_us;
  o.overhead_p99_us = o.router_p99_us - o.direct_p99_us;
  return o;
}

}  // namespace pd::bench
