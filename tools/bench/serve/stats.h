#pragma once
/// What `pdserve bench serve` measures about one request, and the statistics of a level (a
/// concurrency or a request rate), with the definitions of vLLM's benchmarks/benchmark_serving.py
/// so numbers compare across servers:
///  - TTFT: request sent → first chunk carrying output (text or token ids).
///  - ITL: every gap between consecutive output chunks; a chunk carrying k > 1 tokens counts as
///    k gaps of (gap / k) each, so multi-token chunks (MTP) give per-token latencies.
///  - TPOT (per request): (e2e − TTFT) / (output tokens − 1); only requests with > 1 token.
///  - E2E latency: request sent → end of the stream.
///  - Throughputs: totals over the level's wall time (first send → last answer).
///  - Goodput: requests/s of the successful requests meeting every SLO given (TTFT, TPOT, E2E);
///    a one-token request has TPOT 0 there.
/// Percentiles interpolate linearly between order statistics (numpy's default).
///
/// Thread rules: plain values and pure functions.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace pd::bench {

/// One request as the client saw it. Times in seconds.
struct RequestResult {
  bool ok = false;
  std::string error;               ///< why it failed (HTTP status and message, cut stream, ...)
  double ttft_s = 0;               ///< 0 when no output arrived
  double e2e_s = 0;                ///< send → end of the response (also for failures)
  std::vector<double> itl_s;       ///< per-token inter-token latencies (see the file comment)
  std::int64_t prompt_tokens = 0;  ///< from usage when the server sent it, else the generated length
  std::int64_t output_tokens = 0;  ///< from usage when sent, else token ids or chunks counted
  std::int64_t chunks = 0;         ///< output chunks received
  /// usage.prompt_tokens_details.cached_tokens: prompt tokens the server reused from its prefix
  /// cache (0 when not reported).
  std::int64_t cached_tokens = 0;
  /// The output's token ids, when the server returned them per chunk (return_token_ids).
  std::vector<std::int64_t> token_ids;
};

/// Latency summary in milliseconds.
struct Distribution {
  double mean = 0;
  double p50 = 0;
  double p90 = 0;
  double p99 = 0;
  double max = 0;
  std::int64_t count = 0;
};

/// SLOs for goodput; an unset one is not checked.
struct Slo {
  std::optional<double> ttft_ms;
  std::optional<double> tpot_ms;
  std::optional<double> e2e_ms;
  [[nodiscard]] bool any() const { return ttft_ms || tpot_ms || e2e_ms; }
};

struct ErrorCount {
  std::string message;
  std::int64_t count = 0;
};

/// Server-side speculative decoding over a level, from counter deltas of /metrics.
struct MtpStats {
  double drafts_proposed = 0;
  double drafts_accepted = 0;
  double generated_tokens = 0;
  double steps = 0;
  /// accepted / proposed; unset when nothing was proposed.
  std::optional<double> acceptance_rate;
  /// Drafts accepted per sequence step: accepted / (generated − accepted), as each sequence step
  /// yields one verified token plus its accepted drafts. Tokens per step = 1 + this.
  std::optional<double> accepted_tokens_per_step;
};

/// The prefill workers' own timings over a level, from deltas of their /metrics (docs/benchmarks.md,
/// "Prefill and KV transfer per prompt"): means per prompt prefilled in the level's timed part.
struct PrefillServerStats {
  double prompts = 0;                    ///< prefills that finished (pdserve_prefill_compute_seconds_count)
  std::optional<double> queue_ms;        ///< submit to first forward
  std::optional<double> compute_ms;      ///< first forward to last layer computed
  std::optional<double> kv_tail_ms;      ///< last layer computed to completion record delivered: what the KV
                                         ///< transfer adds to TTFT (the rest overlaps the compute)
  std::optional<double> kv_transfer_ms;  ///< a whole send-side transfer, begin to answer (overlaps the compute)
  std::optional<double> kv_bytes;        ///< KV bytes put
};

struct LevelStats {
  std::int64_t concurrency = 0;  ///< 0 in request-rate mode
  double request_rate = 0;       ///< 0 (unbounded) in concurrency mode
  std::int64_t completed = 0;
  std::int64_t failed = 0;
  std::vector<ErrorCount> errors;  ///< distinct error messages, most frequent first
  double duration_s = 0;
  std::int64_t total_input_tokens = 0;
  std::int64_t total_output_tokens = 0;
  double request_throughput = 0;  ///< completed / duration
  double output_throughput = 0;   ///< output tokens / s
  double total_token_throughput = 0;
  double mean_concurrency = 0;            ///< Σ e2e / duration (Little's law: requests in flight on average)
  std::optional<double> request_goodput;  ///< set when an SLO was given
  Distribution ttft_ms;
  Distribution tpot_ms;
  Distribution itl_ms;
  Distribution e2e_ms;
  std::optional<MtpStats> mtp;
  std::optional<PrefillServerStats> prefill;
};

/// Linear-interpolation percentile of `values` (p in 0..100); 0 for no values.
double percentile(std::vector<double> values, double p);
/// mean, p50, p90, p99 and max of seconds, reported in milliseconds.
Distribution summarizeMs(const std::vector<double>& seconds);
/// TPOT of one request in seconds; nullopt unless it succeeded with more than one output token.
std::optional<double> tpotSeconds(const RequestResult& r);
/// Whether a successful request meets every SLO given.
bool meetsSlo(const RequestResult& r, const Slo& slo);
/// The ITL entries for one gap of `gap_s` that delivered `tokens` tokens (k ≥ 1 entries of gap/k).
void appendItl(std::vector<double>& itl, double gap_s, std::int64_t tokens);
/// The level's statistics. `duration_s` is its wall time (> 0).
LevelStats summarize(const std::vector<RequestResult>& results, double duration_s, const Slo& slo);
/// MTP statistics from counter deltas; nullopt when the server exported none of the counters.
std::optional<MtpStats> mtpFromDeltas(std::optional<double> proposed, std::optional<double> accepted,
                                      std::optional<double> generated, std::optional<double> steps);

}  // namespace pd::bench
