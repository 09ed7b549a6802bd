#pragma once
/// Router settings (section `router:`). Thread rules: filled once in main, then read-only.

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "pd/common/config.h"

namespace pd::router {

struct RouterConfig {
  std::string host = "127.0.0.1";
  std::int64_t port = 8000;
  std::int64_t io_threads = 2;
  std::int64_t cpu_threads = 2;
  std::int64_t cpu_queue = 1024;
  std::int64_t cpu_inline_bytes = 4096;
  std::int64_t max_body_bytes = 8 << 20;
  std::int64_t max_queued_requests = 256;
  std::int64_t request_timeout_ms = 600000;
  std::filesystem::path api_keys_file;
  /// The per-request log line carries the prompt (docs/observability.md); off: never.
  bool log_prompts = false;
  std::string served_model_name = "pdserve-default";
  std::int64_t retry_after_s = 1;
  std::int64_t drain_timeout_ms = 30000;

  // Workers (worker_registry.h): static "host:port" lists and/or DNS names ("name:port") whose
  // every address is a worker (Kubernetes headless services).
  std::vector<std::string> prefill_workers;
  std::vector<std::string> decode_workers;
  std::string prefill_service;
  std::string decode_service;
  std::int64_t discovery_interval_ms = 5000;
  std::int64_t health_interval_ms = 1000;
  std::int64_t health_timeout_ms = 1000;
  std::int64_t health_failures = 3;
  std::string model_hash;  ///< expected worker model_hash; empty: the first one a ready worker reports

  // Orchestration (pd_backend.h); routing (worker_policy.h, docs/routing.md).
  std::string prefill_policy = "auto";
  std::int64_t kv_events_interval_ms = 50;       ///< how often each prefill worker's KV events are read
  std::int64_t kv_index_max_blocks = 262144;     ///< most blocks the router indexes per prefill worker
  std::int64_t cache_aware_balance_abs = 32;     ///< cache_aware: imbalance threshold, requests
  double cache_aware_balance_rel = 1.5;          ///< cache_aware: imbalance threshold, ratio
  std::int64_t decode_affinity_entries = 65536;  ///< conversations remembered for decode affinity
  std::int64_t prefill_retries = 1;
  std::int64_t decode_retries = 1;
  std::int64_t max_resumes = 2;
  /// Conditional disaggregation (docs/kv-memory.md, "Local prefill"): a prompt shorter than this
  /// is prefilled by its decode worker itself, with no prefill worker and no KV transfer. 0: every
  /// prompt goes to a prefill worker.
  std::int64_t remote_prefill_min_tokens = 0;
  std::int64_t max_n = 16;  ///< most choices (OpenAI `n`) one request may ask for
  std::int64_t decode_open_timeout_ms = 10000;
  std::int64_t kv_timeout_ms = 60000;
  std::int64_t prefill_timeout_ms = 60000;
  std::int64_t stream_stall_timeout_ms = 30000;
  std::int64_t abort_timeout_ms = 2000;
  std::int64_t max_generations = 4096;
  std::int64_t pool_idle_ms = 55000;
  // Output parsing (docs/api.md): auto reads the chat template.
  std::string tool_parser = "auto";       ///< auto | deepseek_v3 | deepseek_v31 | none
  std::string reasoning_parser = "auto";  ///< auto | deepseek_r1 | none
};

void registerOptions(config::OptionSet& set, RouterConfig& cfg);

/// The prefill policy `cfg.prefill_policy` names, with "auto" resolved: cache_aware with more than
/// one static prefill worker or a prefill service, least_queued_tokens otherwise.
[[nodiscard]] std::string resolvePrefillPolicy(const RouterConfig& cfg);

}  // namespace pd::router
