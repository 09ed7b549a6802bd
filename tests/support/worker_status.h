#pragma once
// A worker's internal status (GET /v1/internal/status, docs/internal-api.md) for the end-to-end
// tests: one read, or polling until the status satisfies a condition (an end state the worker
// reaches on its own, which no event announces to the test).
// Thread rules: free functions; blocking.

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <thread>

#include "pd/common/http_client.h"
#include "pd/common/worker_api.h"

namespace pd::test {

/// The worker's status, or nullopt when it does not answer 200 with a status that parses.
inline std::optional<worker_api::WorkerStatus> fetchWorkerStatus(
    const std::string& host, std::uint16_t port, std::chrono::milliseconds timeout = std::chrono::seconds(5)) {
  http::Client client(host, port);
  http::ClientRequest req;
  req.method = "GET";
  req.target = std::string(worker_api::kStatusPath);
  auto r = client.send(req, timeout);
  if (!r.ok() || r->status != 200) return std::nullopt;
  auto parsed = worker_api::parseWorkerStatus(r->body);
  if (!parsed.ok()) return std::nullopt;
  return std::move(parsed).value();
}

/// Reads the status every `poll` until `done` holds for it or `within` has passed; returns the
/// last status read (nullopt if none was), so that a failed wait can say what the worker held.
inline std::optional<worker_api::WorkerStatus> waitWorkerStatus(
    const std::string& host, std::uint16_t port, const std::function<bool(const worker_api::WorkerStatus&)>& done,
    std::chrono::milliseconds within = std::chrono::seconds(30),
    std::chrono::milliseconds poll = std::chrono::milliseconds(50)) {
  std::optional<worker_api::WorkerStatus> last;
  for (const auto until = std::chrono::steady_clock::now() + within;;) {
    if (auto s = fetchWorkerStatus(host, port)) {
      last = std::move(s);
      if (done(*last)) return last;
    }
    if (std::chrono::steady_clock::now() >= until) return last;
    std::this_thread::sleep_for(poll);
  }
}

/// Nothing running or queued, and for a decode worker every block free (idle cached blocks count
/// as free) and none quarantined: the end state of a worker that leaked nothing.
inline bool workerIsClean(const worker_api::WorkerStatus& s) {
  return s.running_requests == 0 && s.queued_requests == 0 &&
         (s.role != "decode" || (s.free_blocks == s.total_blocks && s.quarantined_blocks == 0));
}

}  // namespace pd::test
