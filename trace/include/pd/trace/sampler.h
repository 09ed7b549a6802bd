#pragma once
/// Which traces are recorded. Parent-based: a span with a parent (local or from a client's
/// `traceparent`) follows the parent's sampled flag, so a trace is recorded in every process or
/// in none; a root span is sampled when its trace id falls under the ratio (the trace id's last
/// 8 bytes as a big-endian number below ratio * 2^64, as OpenTelemetry's TraceIdRatioBased
/// sampler does), so the decision is a function of the id alone.
///
/// Thread rules: immutable after construction; thread-safe.

#include <cstdint>
#include <optional>

#include "pd/trace/trace_context.h"

namespace pd::trace {

class Sampler {
 public:
  /// `ratio` in [0, 1] (checked): 0 records nothing, 1 every root.
  explicit Sampler(double ratio);

  /// The decision for a new span of trace `trace_id` whose parent is `parent` (nullopt: a root).
  [[nodiscard]] bool shouldSample(const std::optional<SpanContext>& parent, const TraceId& trace_id) const;
  [[nodiscard]] double ratio() const { return ratio_; }

 private:
  double ratio_;
  std::uint64_t threshold_;  // sample a root when its id's low 8 bytes < threshold_
  bool always_;
};

}  // namespace pd::trace
