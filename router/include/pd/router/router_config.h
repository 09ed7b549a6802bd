#pragma once
/// Router settings (section `router:`). Thread rules: filled once in main, then read-only.

#include <cstdint>
#include <filesystem>
#include <string>

#include "pd/common/config.h"

namespace pd::router {

struct RouterConfig {
  std::string host = "127.0.0.1";
  std::int64_t port = 8000;
  std::int64_t io_threads = 2;
  std::int64_t max_body_bytes = 8 << 20;
  std::int64_t max_queued_requests = 256;
  std::int64_t request_timeout_ms = 600000;
  std::filesystem::path api_keys_file;
  std::string served_model_name = "pdserve-default";
  std::int64_t retry_after_s = 1;
};

void registerOptions(config::OptionSet& set, RouterConfig& cfg);

}  // namespace pd::router
