#pragma once
/// The `trace:` configuration section, shared by every role (router, prefill, decode).
/// Thread rules: a plain struct; filled once in main, then read-only.

#include <cstdint>
#include <filesystem>
#include <string>

#include "pd/common/config.h"
#include "pd/common/result.h"

namespace pd::trace {

struct TraceConfig {
  /// OTLP/HTTP collector, e.g. http://127.0.0.1:4318 (the path defaults to /v1/traces).
  std::string otlp_url;
  /// JSON lines file (one OTLP JSON request per line and batch).
  std::filesystem::path file;
  /// Share of new traces recorded; a trace continued from a `traceparent` follows its sampled flag.
  double sample_ratio = 1.0;
  std::int64_t queue_size = 4096;
  std::int64_t batch_size = 512;
  std::int64_t export_interval_ms = 1000;
  std::int64_t export_timeout_ms = 2000;
  /// service.name in the traces; empty: "pdserve-<role>".
  std::string service_name;
};

/// Binds the fields of `cfg` to `set` (the section is conventionally "trace").
void registerOptions(config::OptionSet& set, TraceConfig& cfg);
/// Cross-field checks (none beyond the option bounds today); InvalidArgument names the option.
[[nodiscard]] Status validate(const TraceConfig& cfg);

}  // namespace pd::trace
