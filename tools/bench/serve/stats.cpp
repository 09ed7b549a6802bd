// Statistics of `pdserve bench serve` (definitions in stats.h).
#include "bench/serve/stats.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>

namespace pd::bench {

double percentile(std::vector<double> values, double p) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  const double rank = std::clamp(p, 0.0, 100.0) / 100.0 * static_cast<double>(values.size() - 1);
  const auto lo = static_cast<std::size_t>(std::floor(rank));
  const auto hi = std::min(lo + 1, values.size() - 1);
  const double frac = rank - static_cast<double>(lo);
  return values[lo] + (values[hi] - values[lo]) * frac;
}

Distribution summarizeMs(const std::vector<double>& seconds) {
  Distribution d;
  d.count = static_cast<std::int64_t>(seconds.size());
  if (seconds.empty()) return d;
  std::vector<double> ms(seconds.size());
  std::transform(seconds.begin(), seconds.end(), ms.begin(), [](double s) { return s * 1e3; });
  d.mean = std::accumulate(ms.begin(), ms.end(), 0.0) / static_cast<double>(ms.size());
  d.p50 = percentile(ms, 50);
  d.p90 = percentile(ms, 90);
  d.p99 = percentile(ms, 99);
  d.max = *std::max_element(ms.begin(), ms.end());
  return d;
}

std::optional<double> tpotSeconds(const RequestResult& r) {
  if (!r.ok || r.output_tokens <= 1) return std::nullopt;
  return (r.e2e_s - r.ttft_s) / static_cast<double>(r.output_tokens - 1);
}

bool meetsSlo(const RequestResult& r, const Slo& slo) {
  if (!r.ok) return false;
  if (slo.ttft_ms && r.ttft_s * 1e3 > *slo.ttft_ms) return false;
  if (slo.tpot_ms && tpotSeconds(r).value_or(0.0) * 1e3 > *slo.tpot_ms) return false;
  if (slo.e2e_ms && r.e2e_s * 1e3 > *slo.e2e_ms) return false;
  return true;
}

void appendItl(std::vector<double>& itl, double gap_s, std::int64_t tokens) {
  const std::int64_t k = std::max<std::int64_t>(tokens, 1);
  for (std::int64_t i = 0; i < k; ++i) itl.push_back(gap_s / static_cast<double>(k));
}

LevelStats summarize(const std::vector<RequestResult>& results, double duration_s, const Slo& slo) {
  LevelStats s;
  s.duration_s = duration_s;
  std::vector<double> ttft;
  std::vector<double> tpot;
  std::vector<double> itl;
  std::vector<double> e2e;
  std::map<std::string, std::int64_t> errors;
  std::int64_t good = 0;
  double busy_s = 0;
  for (const auto& r : results) {
    busy_s += r.e2e_s;
    if (!r.ok) {
      ++s.failed;
      ++errors[r.error.empty() ? std::string("unknown error") : r.error];
      continue;
    }
    ++s.completed;
    s.total_input_tokens += r.prompt_tokens;
    s.total_output_tokens += r.output_tokens;
    ttft.push_back(r.ttft_s);
    e2e.push_back(r.e2e_s);
    if (auto t = tpotSeconds(r)) tpot.push_back(*t);
    itl.insert(itl.end(), r.itl_s.begin(), r.itl_s.end());
    if (meetsSlo(r, slo)) ++good;
  }
  for (const auto& [message, count] : errors) s.errors.push_back({message, count});
  std::stable_sort(s.errors.begin(), s.errors.end(),
                   [](const ErrorCount& a, const ErrorCount& b) { return a.count > b.count; });
  if (duration_s > 0) {
    s.request_throughput = static_cast<double>(s.completed) / duration_s;
    s.output_throughput = static_cast<double>(s.total_output_tokens) / duration_s;
    s.total_token_throughput = static_cast<double>(s.total_input_tokens + s.total_output_tokens) / duration_s;
    s.mean_concurrency = busy_s / duration_s;
    if (slo.any()) s.request_goodput = static_cast<double>(good) / duration_s;
  }
  s.ttft_ms = summarizeMs(ttft);
  s.tpot_ms = summarizeMs(tpot);
  s.itl_ms = summarizeMs(itl);
  s.e2e_ms = summarizeMs(e2e);
  return s;
}

std::optional<MtpStats> mtpFromDeltas(std::optional<double> proposed, std::optional<double> accepted,
                                      std::optional<double> generated, std::optional<double> steps) {
  if (!proposed && !accepted && !generated && !steps) return std::nullopt;
  MtpStats m;
  m.drafts_proposed = proposed.value_or(0);
  m.drafts_accepted = accepted.value_or(0);
  m.generated_tokens = generated.value_or(0);
  m.steps = steps.value_or(0);
  if (m.drafts_proposed > 0) m.acceptance_rate = m.drafts_accepted / m.drafts_proposed;
  const double sequence_steps = m.generated_tokens - m.drafts_accepted;
  if (generated && accepted && sequence_steps > 0) m.accepted_tokens_per_step = m.drafts_accepted / sequence_steps;
  return m;
}

}  // namespace pd::bench
