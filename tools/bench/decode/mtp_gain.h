#pragma once
/// The arithmetic of `pdserve bench decode`'s MTP rows: a speculative run against a plain (MTP
/// off) run of the same requests made right before it.
///  - accepted per step = drafts accepted / steps;
///  - relative cost = (main + MTP forward time per step) / plain forward time per step - 1;
///  - measured speedup = speculative tokens/s / plain tokens/s;
///  - ideal speedup = (1 + accepted per step) / (1 + relative cost), what the measured acceptance
///    allows at the measured cost; over ideal = measured / ideal.
/// The run itself (the decode engine, the bench-only draft override) is decode_bench.h's.
///
/// Thread rules: pure functions.

#include <cstdint>

namespace pd::bench {

/// What the timed steps of one run add up to.
struct StepTotals {
  std::int64_t steps = 0;
  std::int64_t tokens = 0;       ///< emitted by the timed steps
  double wall_seconds = 0.0;     ///< sum of the timed steps
  double forward_seconds = 0.0;  ///< main-model forward calls
  double mtp_seconds = 0.0;      ///< MTP forward calls
  std::int64_t drafts_proposed = 0;
  std::int64_t drafts_accepted = 0;
};

struct MtpGain {
  double accepted_per_step = 0.0;
  double relative_cost = 0.0;
  double measured_speedup = 0.0;
  double ideal_speedup = 0.0;
  double over_ideal = 0.0;
};

/// The gain of `speculative` over `plain` (see above); zeros where a run has no steps or time.
[[nodiscard]] MtpGain mtpGain(const StepTotals& plain, const StepTotals& speculative);

/// Drafts accepted / proposed; 0 when none were proposed.
[[nodiscard]] double acceptanceRate(const StepTotals& run);

/// Memory-bandwidth utilization of decode steps: bytes read per step / median step time / read
/// bandwidth (0 when a denominator is not positive).
[[nodiscard]] double decodeMbu(double bytes_per_step, double median_step_seconds, double bandwidth);

}  // namespace pd::bench
