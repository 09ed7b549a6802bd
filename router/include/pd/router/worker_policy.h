#pragma once
/// How the router picks a worker among those in rotation (DESIGN §3). A policy sees each
/// worker's last polled status plus what the router itself sent it since that poll, so a burst
/// of requests between two polls spreads over the pool instead of piling onto one worker.
///
///   least_queued_tokens (prefill): fewest queued tokens (polled + sent), then fewest requests.
///   round_robin (prefill, optional): each worker in turn.
///   most_free_blocks (decode): most free KV blocks (polled, less the blocks of what was sent),
///     then fewest running sequences.
///
/// Ties go to the first candidate (candidates come ordered by address).
///
/// Thread rules: thread-safe; choose() may run on many threads at once.

#include <cstddef>
#include <memory>
#include <span>
#include <string_view>

#include "pd/common/result.h"
#include "pd/router/worker_registry.h"

namespace pd::router {

class WorkerPolicy {
 public:
  WorkerPolicy() = default;
  virtual ~WorkerPolicy() = default;
  WorkerPolicy(const WorkerPolicy&) = delete;
  WorkerPolicy& operator=(const WorkerPolicy&) = delete;
  WorkerPolicy(WorkerPolicy&&) = delete;
  WorkerPolicy& operator=(WorkerPolicy&&) = delete;
  /// The index in `candidates` (not empty) of the worker to use.
  [[nodiscard]] virtual std::size_t choose(std::span<const WorkerView> candidates) = 0;
};

[[nodiscard]] std::unique_ptr<WorkerPolicy> makeLeastQueuedTokensPolicy();
[[nodiscard]] std::unique_ptr<WorkerPolicy> makeRoundRobinPolicy();
[[nodiscard]] std::unique_ptr<WorkerPolicy> makeMostFreeBlocksPolicy();
/// "least_queued_tokens" or "round_robin"; InvalidArgument otherwise.
[[nodiscard]] Result<std::unique_ptr<WorkerPolicy>> makePrefillPolicy(std::string_view name);

}  // namespace pd::router
