#pragma once
/// KV transfer settings (section `kvtransfer:`). Thread rules: filled once in main, then read-only.

#include <cstdint>
#include <string>

#include "pd/common/config.h"

namespace pd::kvtransfer {

struct KvTransferConfig {
  /// UCX transports. Must include tcp: shared-memory-only transports refuse peer error handling.
  std::string ucx_tls = "tcp,sm";
  std::int64_t transfer_timeout_ms = 30000;
  std::int64_t connect_timeout_ms = 5000;
};

void registerOptions(config::OptionSet& set, KvTransferConfig& cfg);

}  // namespace pd::kvtransfer
