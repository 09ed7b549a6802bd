#include "pd/trace/trace_config.h"

#include <fmt/format.h>

namespace pd::trace {

void registerOptions(config::OptionSet& set, TraceConfig& cfg) {
  set.add("otlp_url", &cfg.otlp_url,
          "OTLP/HTTP JSON collector URL for spans (http://host:port[/path], path default /v1/traces); empty: none")
      .add("file", &cfg.file, "write spans as JSON lines (OTLP JSON, one batch per line) to this file; empty: none")
      .add("sample_ratio", &cfg.sample_ratio,
           "share of new traces recorded; requests with a traceparent follow its sampled flag", 0.0, 1.0)
      .add("queue_size", &cfg.queue_size, "finished spans waiting for export; more are dropped and counted", 1, 1 << 20)
      .add("batch_size", &cfg.batch_size, "spans per export call", 1, 1 << 16)
      .add("export_interval_ms", &cfg.export_interval_ms, "longest a span waits before export", 1, 600000)
      .add("export_timeout_ms", &cfg.export_timeout_ms, "deadline of one export call to the collector", 1, 600000)
      .add("service_name", &cfg.service_name, "service.name of this process's spans; empty: pdserve-<role>");
}

Status validate(const TraceConfig& cfg) {
  if (!cfg.otlp_url.empty() && cfg.otlp_url.rfind("http://", 0) != 0) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("trace.otlp_url '{}': only http:// URLs are supported", cfg.otlp_url));
  }
  return okStatus();
}

}  // namespace pd::trace
