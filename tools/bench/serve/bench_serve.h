#pragma once
/// `pdserve bench serve`: the OpenAI-API load generator (docs/benchmarks.md, "bench serve").
///
/// Sends streaming /v1/completions or /v1/chat/completions requests to pdserve's router or any
/// OpenAI-compatible server (vLLM, SGLang) at a sweep of fixed concurrencies or Poisson request
/// rates, and reports per level TTFT, TPOT, ITL and end-to-end latency (mean, p50, p90, p99),
/// throughputs, goodput under SLOs, failures, and MTP acceptance from the servers' /metrics.
/// The parts are workload.h, runner.h, stats.h, server_metrics.h, report.h; this is the sweep.
///
/// Thread rules: runServeBench() blocks the caller (runLevel's client threads do the sending);
/// the rest is pure.

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "pd/common/result.h"

namespace pd::bench {

struct ServeBenchConfig {
  std::string url = "http://127.0.0.1:8000";
  std::string model;  ///< empty: the first of GET /v1/models
  std::string endpoint = "completions";
  std::string api_key;
  std::int64_t input_tokens = 128;
  std::int64_t output_tokens = 128;
  std::filesystem::path prompts;
  std::string concurrency = "1,2,4,8,16,32,64,128";
  std::string request_rate;  ///< not empty: open-loop rate levels instead of concurrencies
  std::int64_t max_concurrency = 256;
  std::int64_t num_prompts = 0;
  std::int64_t warmup = -1;
  std::int64_t seed = 0;
  bool ignore_eos = true;
  bool return_token_ids = true;
  double temperature = 0;
  std::int64_t token_id_min = 100;
  std::int64_t token_id_max = 0;  ///< 0: the served vocabulary
  double slo_ttft_ms = 0;
  double slo_tpot_ms = 0;
  double slo_e2e_ms = 0;
  std::vector<std::string> metrics_url;
  std::int64_t timeout_s = 600;
  std::string json;      ///< file of the JSON report; "-": stdout; empty: none
  std::string markdown;  ///< file of the markdown table; "-": stdout; empty: stdout unless json is
  std::filesystem::path svg;
  double net_latency_ms = -1;
  bool quiet = false;
  /// "random" (the sweep above), or a prefix-reuse workload (conversation.h): "multiturn",
  /// "shared-prefix". Those run once at the first --concurrency level, against --url and then,
  /// when given, --baseline_url.
  std::string workload = "random";
  std::string baseline_url;
  /// Multiturn: the prefill workers' /metrics pages of --baseline_url's cluster (with metrics_url,
  /// those of --url's): KV bytes put per later turn and transfer_bytes_ratio.
  std::vector<std::string> baseline_metrics_url;
  std::int64_t conversations = 8;
  std::int64_t turns = 4;
  std::int64_t system_tokens = 1024;
  std::int64_t turn_tokens = 128;
  std::int64_t prefixes = 4;
  std::int64_t prefix_tokens = 2048;
  std::int64_t suffix_tokens = 32;
  std::int64_t requests_per_prefix = 8;
};

/// The levels of the sweep after the checks the option table cannot make: token_id_min below a
/// non-zero token_id_max; request_rate's positive rates, or else concurrency's integers 1..4096.
[[nodiscard]] Result<std::vector<double>> serveLevels(const ServeBenchConfig& cfg);

/// How many requests one level sends.
struct LevelSize {
  std::int64_t workers = 0;   ///< concurrent senders
  std::int64_t requests = 0;  ///< timed
  std::int64_t warmup = 0;    ///< untimed, before
};
/// Concurrency mode: level concurrent workers, num_prompts (0: max(16, 4 x level)) timed, warmup
/// (-1: one per worker). Rate mode: max_concurrency workers, num_prompts (0: 20 s of arrivals,
/// clamped to 16..10000), warmup (-1: min(4, workers)).
[[nodiscard]] LevelSize levelSize(const ServeBenchConfig& cfg, double level);

/// The model folder to read the vocabulary from when neither the server nor token_id_max gives
/// it (called at most once).
using ModelDirSource = std::function<Result<std::filesystem::path>()>;

/// Runs every level against the server and writes the reports. Failures before the first level
/// (bad URL, no model list and no model name, unreadable prompts or metrics pages) are errors;
/// a level that completes no request makes the result PeerFailed after the reports are written.
[[nodiscard]] Result<void> runServeBench(ServeBenchConfig cfg, const ModelDirSource& model_dir);

}  // namespace pd::bench
