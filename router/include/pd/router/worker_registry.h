#pragma once
/// The router's view of its prefill and decode workers: who they are (static "host:port" lists
/// and DNS names whose every address is a worker, re-resolved periodically, as Kubernetes
/// headless services give them), and whether each may take requests now (health polling of
/// GET /v1/internal/status, docs/internal-api.md).
///
/// A worker is in rotation when its last poll succeeded and reported ready, not draining, the
/// role of its pool and the deployment's model_hash (the configured one, or else the first one a
/// ready worker reported). It leaves rotation at once when a poll says otherwise, and after
/// `health_failures` failed polls (or failures reported by requests) in a row; it comes back
/// with its next good poll. A worker never polled successfully is out of rotation.
///
/// A busy worker (WorkerStatus::busy: healthy, but its pool or queue is full, so its /ready is
/// 503) stays in rotation — its poll is a good one, nothing counts against it — but ready()
/// offers it only while every worker of its role in rotation is busy: work goes around it while
/// others have room, and is not refused at the door when all are full at the last poll.
///
/// The registry also counts what the router sent each worker since its last good poll, so the
/// policies (worker_policy.h) see a burst of requests spread out before the next poll shows it.
///
/// With `kv_events`, the registry also follows each prefill worker's KV events (GET
/// /v1/internal/kv_events every `kv_events_interval` while it is in rotation, at once again while
/// the worker says more follow) into a PrefixIndex (prefix_index.h) for the cache_aware policy. An
/// answer that is malformed, names another model hash than the worker's status, or does not
/// continue the index is refused and the worker's index forgotten (the next read asks for a
/// snapshot); a worker that leaves the registry is forgotten too.
///
/// Errors: start() fails with InvalidArgument for a malformed address or service name.
///
/// Thread rules: thread-safe. Each worker is polled by its own thread (a prefill worker by a
/// second one for its KV events, with kv_events); one more thread re-resolves the service names. The destructor stops
/// and joins them all (a poll in progress is cancelled, so it returns promptly).

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "pd/common/internal_auth.h"
#include "pd/common/metrics.h"
#include "pd/common/result.h"
#include "pd/common/worker_api.h"
#include "pd/router/prefix_index.h"
#include "pd/router/router_config.h"

namespace pd::router {

enum class WorkerRole { Prefill, Decode };

/// "prefill" or "decode", as WorkerStatus::role spells it.
[[nodiscard]] std::string_view roleName(WorkerRole role);

struct WorkerAddress {
  std::string host;  ///< a name or numeric address (IPv6 without brackets)
  std::uint16_t port = 0;
  /// "host:port", or "[v6]:port".
  [[nodiscard]] std::string key() const;
  friend bool operator==(const WorkerAddress&, const WorkerAddress&) = default;
};

/// Parses "host:port" or "[ipv6]:port" (port 1..65535). InvalidArgument naming `what` otherwise.
[[nodiscard]] Result<WorkerAddress> parseWorkerAddress(std::string_view text, std::string_view what);

/// Every address `name` resolves to (IPv4 and IPv6, sorted, without duplicates) with `port`.
/// NotFound when the name does not resolve. Blocks for the resolver.
[[nodiscard]] Result<std::vector<WorkerAddress>> resolveAll(const std::string& name, std::uint16_t port);

/// A worker in rotation, as policies see it.
struct WorkerView {
  WorkerAddress address;
  worker_api::WorkerStatus status;  ///< from the last good poll
  std::int64_t sent_requests = 0;   ///< requests the router sent it since that poll
  std::int64_t sent_tokens = 0;     ///< their tokens (prefill: prompt; decode: prompt + max_tokens)
  /// Requests the router has sent it and not had answered yet (noteInFlight); not reset by polls.
  std::int64_t in_flight = 0;
  std::int64_t in_flight_tokens = 0;  ///< the tokens the worker computes for them (uncached)
};

/// Everything the registry knows about one worker (logs, tests, metrics).
struct WorkerState {
  WorkerAddress address;
  WorkerRole role = WorkerRole::Prefill;
  bool discovered = false;  ///< from a service name rather than a static list
  bool in_rotation = false;
  std::string reason;  ///< why it is out of rotation; empty when in
  std::int64_t consecutive_failures = 0;
  std::int64_t good_polls = 0;
  std::optional<worker_api::WorkerStatus> status;  ///< last good poll
};

struct RegistryOptions {
  std::vector<WorkerAddress> prefill_workers;
  std::vector<WorkerAddress> decode_workers;
  std::optional<WorkerAddress> prefill_service;  ///< host = the DNS name
  std::optional<WorkerAddress> decode_service;
  std::chrono::milliseconds discovery_interval{5000};
  std::chrono::milliseconds health_interval{1000};
  std::chrono::milliseconds health_timeout{1000};
  std::int64_t health_failures = 3;
  std::string model_hash;  ///< empty: pinned to the first one a ready worker reports
  /// Signs the status polls (internal_auth.h); null: unsigned (an unauthenticated plane).
  std::shared_ptr<InternalAuth> auth;
  /// Where each worker's state goes after every poll (may be null; must outlive the registry),
  /// labelled {role, worker="host:port"}: pdserve_router_worker_in_rotation (1 or 0),
  /// pdserve_router_worker_queued_requests, pdserve_router_worker_running_requests,
  /// pdserve_router_worker_kv_blocks_free, pdserve_router_worker_kv_blocks_total and
  /// pdserve_router_worker_mtp_drafts_{proposed,accepted} (from the last good poll). A worker that
  /// leaves (discovery) reads 0 in rotation.
  metrics::Registry* metrics = nullptr;
  /// Follow the prefill workers' KV events into prefixIndex() (cache_aware routing).
  bool kv_events = false;
  std::chrono::milliseconds kv_events_interval{50};
  std::int64_t kv_index_max_blocks = 262144;  ///< per worker (PrefixIndex)
};

/// The registry options of the router section. InvalidArgument for a malformed address.
[[nodiscard]] Result<RegistryOptions> registryOptionsFromConfig(const RouterConfig& config);

class WorkerRegistry {
 public:
  /// Starts polling the static workers and resolving the services (first rounds at once).
  [[nodiscard]] static Result<std::unique_ptr<WorkerRegistry>> start(RegistryOptions options);
  WorkerRegistry(const WorkerRegistry&) = delete;
  WorkerRegistry& operator=(const WorkerRegistry&) = delete;
  WorkerRegistry(WorkerRegistry&&) = delete;
  WorkerRegistry& operator=(WorkerRegistry&&) = delete;
  ~WorkerRegistry();

  /// The workers of `role` in rotation that are not busy, ordered by address key; when all of
  /// them are busy, all of them.
  [[nodiscard]] std::vector<WorkerView> ready(WorkerRole role) const;
  [[nodiscard]] bool hasReady(WorkerRole role) const;
  /// Every known worker of both roles.
  [[nodiscard]] std::vector<WorkerState> workers() const;
  /// The router sent `worker` a request of `tokens` tokens (see WorkerView).
  void noteSent(WorkerRole role, const std::string& worker, std::int64_t tokens);
  /// The router's requests to `worker` awaiting an answer changed by `delta` (+1 sent, -1
  /// answered) and their tokens by `tokens`.
  void noteInFlight(WorkerRole role, const std::string& worker, std::int64_t delta, std::int64_t tokens);
  /// A request could not reach `worker` (connection failure or timeout): counts as a failed poll.
  void reportFailure(WorkerRole role, const std::string& worker, const std::string& why);
  /// What the prefill workers' KV events say they hold; null without RegistryOptions::kv_events.
  /// Lives as long as the registry.
  [[nodiscard]] const PrefixIndex* prefixIndex() const;

  class Impl;

 private:
  explicit WorkerRegistry(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace pd::router
