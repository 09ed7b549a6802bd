// The pure parts of bench decode (decode_bench.h): a run's median and totals, the MTP rows and
// their JSON, the sweep rows' JSON, and sysfs cache sizes.
#include <fmt/format.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "bench/decode/decode_bench.h"

namespace pd::bench {

double DecodeRun::medianStep() const {
  std::vector<double> t = step_seconds;
  std::sort(t.begin(), t.end());
  return t.empty() ? 0.0 : t[t.size() / 2];
}

StepTotals DecodeRun::totals() const {
  return {steps, tokens, wall_seconds, forward_seconds, mtp_seconds, drafts_proposed, drafts_accepted};
}

MtpRow mtpRow(const DecodeRun& plain, DecodeRun run, std::int64_t k, double p) {
  MtpRow row;
  row.p = p;
  row.k = k;
  row.gain = mtpGain(plain.totals(), run.totals());
  row.run = std::move(run);
  return row;
}

std::string mtpRowJson(const MtpRow& r) {
  return fmt::format(
      "{{\"k\": {}, {}\"steps\": {}, \"tokens\": {}, \"acceptance_rate\": {:.4f}, \"accepted_per_step\": {:.4f}, "
      "\"tokens_per_s\": {:.3f}, \"relative_cost\": {:.4f}, \"measured_speedup\": {:.4f}, \"ideal_speedup\": "
      "{:.4f}, \"speedup_over_ideal\": {:.4f}, \"cpu_share\": {:.3f}}}",
      r.k, r.p >= 0 ? fmt::format("\"p\": {:.2f}, ", r.p) : std::string(), r.run.steps, r.run.tokens, r.acceptance(),
      r.gain.accepted_per_step, r.tokensPerSecond(), r.gain.relative_cost, r.gain.measured_speedup,
      r.gain.ideal_speedup, r.gain.over_ideal, r.run.cpu_share);
}

std::string decodeRowJson(const DecodeRun& x, double bandwidth) {
  const double step = x.medianStep();
  const double bytes = x.bytes / static_cast<double>(x.steps);
  return fmt::format(
      "{{\"batch\": {}, \"step_ms\": {:.4f}, \"tokens_per_s\": {:.3f}, \"bytes_per_step\": {:.0f}, \"gbs\": "
      "{:.3f}, "
      "\"mbu\": {:.4f}, \"experts_per_step\": {:.1f}, \"forward_share\": {:.4f}, \"cpu_share\": {:.3f}}}",
      x.batch, step * 1e3, static_cast<double>(x.batch) / step, bytes, bytes / step / 1e9,
      decodeMbu(bytes, step, bandwidth), x.experts / static_cast<double>(x.steps), x.forward_seconds / x.wall_seconds,
      x.cpu_share);
}

std::uint64_t parseCacheSize(const std::string& text) {
  std::uint64_t v = 0;
  std::size_t i = 0;
  while (i < text.size() && text[i] >= '0' && text[i] <= '9') v = v * 10 + static_cast<std::uint64_t>(text[i++] - '0');
  if (i < text.size() && (text[i] == 'K' || text[i] == 'k')) v <<= 10;
  if (i < text.size() && text[i] == 'M') v <<= 20;
  return v;
}

}  // namespace pd::bench
