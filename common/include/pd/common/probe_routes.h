#pragma once
/// The probe routes every pdserve server answers, in one place: GET /health (the process is up:
/// always 200), GET /ready (200 while it takes work, else 503 with the reason), GET /metrics
/// (Prometheus text) and, for the workers, GET /v1/internal/status (worker_api::WorkerStatus).
///
/// Thread rules: the callbacks run on the server's io threads, concurrently; they must be
/// thread-safe and must not block.

#include <functional>
#include <string>
#include <vector>

#include "pd/common/http_server.h"

namespace pd::http {

struct Probes {
  /// Text: "ok", "ready" or the reason, as text/plain (the workers). Json: {"status": "ok" |
  /// "ready" | the reason} (the OpenAI-facing router).
  enum class Format { Text, Json };
  Format format = Format::Text;
  /// Why the server does not take work now ("draining", ...), or empty while it does. Null:
  /// always ready.
  std::function<std::string()> not_ready;
  /// The /metrics body; null: no /metrics route.
  std::function<std::string()> metrics;
  /// The JSON body of GET worker_api::kStatusPath; null: no status route.
  std::function<std::string()> status;
};

/// Appends the probe routes `probes` describes to `routes`.
void addProbeRoutes(std::vector<Route>& routes, Probes probes);

}  // namespace pd::http
