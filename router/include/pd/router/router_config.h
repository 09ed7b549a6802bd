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

  // Orchestration (pd_backend.h).
  std::string prefill_policy = "least_queued_tokens";
  std::int64_t prefill_retries = 1;
  std::int64_t decode_retries = 1;
  std::int64_t max_resumes = 2;
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

}  // namespace pd::router
