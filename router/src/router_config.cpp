#include "pd/router/router_config.h"

namespace pd::router {

void registerOptions(config::OptionSet& set, RouterConfig& cfg) {
  set.add("host", &cfg.host, "address the OpenAI-compatible HTTP server binds")
      .add("port", &cfg.port, "HTTP port (0 = any free port, printed at startup)", 0, 65535)
      .add("io_threads", &cfg.io_threads, "HTTP io_context threads", 1, 256)
      .add("max_body_bytes", &cfg.max_body_bytes, "largest accepted request body; larger is 413", 1024, 1LL << 30)
      .add("max_queued_requests", &cfg.max_queued_requests, "requests waiting for a worker before 429", 1, 1 << 20)
      .add("request_timeout_ms", &cfg.request_timeout_ms, "end-to-end deadline of one request", 100, 86400000)
      .add("api_keys_file", &cfg.api_keys_file, "file of accepted Bearer keys, one per line (empty: no auth)")
      .add("served_model_name", &cfg.served_model_name, "model name reported by /v1/models and required in requests")
      .add("retry_after_s", &cfg.retry_after_s, "Retry-After seconds sent with 429 and 503 answers", 1, 3600);
}

}  // namespace pd::router
