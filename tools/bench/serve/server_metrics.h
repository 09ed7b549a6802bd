#pragma once
/// Reads counters from servers' Prometheus /metrics pages, for the server-side numbers of
/// `pdserve bench serve` (MTP acceptance from pdserve's decode workers:
/// pdserve_decode_mtp_drafts_{proposed,accepted}_total, pdserve_decode_generated_tokens_total,
/// pdserve_decode_steps_total; docs/configuration.md).
///
/// Thread rules: pure functions, except scrapeCounters(), which blocks on HTTP.

#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "bench/serve/stats.h"
#include "pd/common/result.h"

namespace pd::bench {

/// Sums of the samples of each metric family in `text` (Prometheus text format), over all
/// label sets, keyed by sample name. Comments and malformed lines are skipped.
std::map<std::string, double> parsePrometheusText(std::string_view text);

/// Also keys each labelled sample by its name and label set as written, e.g.
/// `pdserve_kv_transfer_seconds_sum{side="send"}`, so one label set can be told from the others.
/// GETs every URL ("http://host:port" means its /metrics) and adds up the sums of
/// parsePrometheusText (several decode workers count together). Errors: the first URL that cannot
/// be read (InvalidArgument for a bad URL, PeerFailed/Timeout, or an HTTP status).
Result<std::map<std::string, double>> scrapeCounters(const std::vector<std::string>& urls,
                                                     std::chrono::milliseconds timeout);

/// How much counter `name` grew from `before` to `after` (a counter missing before counts as 0);
/// nullopt when `after` lacks it.
std::optional<double> counterDelta(const std::map<std::string, double>& before,
                                   const std::map<std::string, double>& after, std::string_view name);

/// The prefill workers' timings per prompt from deltas of their histograms and counters; nullopt
/// when the pages export no prefill histogram or no prompt finished in between.
std::optional<PrefillServerStats> prefillFromDeltas(const std::map<std::string, double>& before,
                                                    const std::map<std::string, double>& after);

/// The counters the MTP statistics use.
inline constexpr std::string_view kMtpProposed = "pdserve_decode_mtp_drafts_proposed_total";
inline constexpr std::string_view kMtpAccepted = "pdserve_decode_mtp_drafts_accepted_total";
inline constexpr std::string_view kDecodeTokens = "pdserve_decode_generated_tokens_total";
inline constexpr std::string_view kDecodeSteps = "pdserve_decode_steps_total";

}  // namespace pd::bench
