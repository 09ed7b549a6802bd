#pragma once
/// Decode worker settings (section `decode:`). Thread rules: filled once in main, then read-only.

#include <cstdint>
#include <string>

#include "pd/common/config.h"

namespace pd::decode {

struct DecodeConfig {
  std::string host = "127.0.0.1";
  std::int64_t port = 0;
  std::int64_t block_size = 64;
  std::int64_t num_blocks = 1024;
  std::int64_t max_running_requests = 64;
  std::int64_t num_speculative_tokens = 1;
  std::int64_t tensor_parallel = 1;
  std::int64_t kv_wait_timeout_ms = 60000;
};

void registerOptions(config::OptionSet& set, DecodeConfig& cfg);

}  // namespace pd::decode
