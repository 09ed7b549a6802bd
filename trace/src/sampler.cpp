#include "pd/trace/sampler.h"

#include <cmath>

#include "pd/common/check.h"

namespace pd::trace {

Sampler::Sampler(double ratio) : ratio_(ratio), threshold_(0), always_(ratio >= 1.0) {
  PD_CHECK(ratio >= 0.0 && ratio <= 1.0);
  // 2^64 * ratio, computed in long double; ratio < 1 keeps it below 2^64.
  if (!always_) threshold_ = static_cast<std::uint64_t>(std::ldexp(static_cast<long double>(ratio), 64));
}

bool Sampler::shouldSample(const std::optional<SpanContext>& parent, const TraceId& trace_id) const {
  if (parent && parent->valid()) return parent->sampled();
  if (always_) return true;
  std::uint64_t low = 0;
  for (std::size_t i = 8; i < 16; ++i) low = (low << 8) | trace_id.bytes[i];
  return low < threshold_;
}

}  // namespace pd::trace
