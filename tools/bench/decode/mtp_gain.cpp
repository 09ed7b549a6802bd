// The MTP speedup arithmetic of bench decode (mtp_gain.h).
#include "bench/decode/mtp_gain.h"

namespace pd::bench {

MtpGain mtpGain(const StepTotals& plain, const StepTotals& speculative) {
  MtpGain g;
  if (plain.steps <= 0 || speculative.steps <= 0 || !(plain.wall_seconds > 0) || !(speculative.wall_seconds > 0) ||
      !(plain.forward_seconds > 0)) {
    return g;
  }
  const double base_tps = static_cast<double>(plain.tokens) / plain.wall_seconds;
  const double base_forward = plain.forward_seconds / static_cast<double>(plain.steps);
  const double spec_forward =
      (speculative.forward_seconds + speculative.mtp_seconds) / static_cast<double>(speculative.steps);
  g.accepted_per_step = static_cast<double>(speculative.drafts_accepted) / static_cast<double>(speculative.steps);
  g.relative_cost = spec_forward / base_forward - 1.0;
  g.measured_speedup =
      base_tps > 0 ? (static_cast<double>(speculative.tokens) / speculative.wall_seconds) / base_tps : 0.0;
  g.ideal_speedup = (1.0 + g.accepted_per_step) / (1.0 + g.relative_cost);
  g.over_ideal = g.ideal_speedup > 0 ? g.measured_speedup / g.ideal_speedup : 0.0;
  return g;
}

double acceptanceRate(const StepTotals& run) {
  return run.drafts_proposed > 0 ? static_cast<double>(run.drafts_accepted) / static_cast<double>(run.drafts_proposed)
                                 : 0.0;
}

double decodeMbu(double bytes_per_step, double median_step_seconds, double bandwidth) {
  if (!(median_step_seconds > 0) || !(bandwidth > 0)) return 0.0;
  return bytes_per_step / median_step_seconds / bandwidth;
}

}  // namespace pd::bench
