#pragma once
/// How the router picks a worker among those in rotation (DESIGN §3, docs/routing.md). A policy
/// sees each worker's last polled status plus what the router itself sent it since that poll, so
/// a burst of requests between two polls spreads over the pool instead of piling onto one worker.
///
/// Prefill (router.prefill_policy):
///   cache_aware: the worker with the least prefill work ahead of the prompt's first token: the
///     prompt's tokens not in the worker's cached prefix (PrefixIndex, learnt from the workers'
///     KV events) plus the tokens waiting there (prefillTokenLoad), then the fewest requests; so
///     the longest cached prefix wins unless the work queued behind it outweighs the reuse. And the
///     least loaded worker whenever the load is imbalanced: the most loaded worker's load exceeds
///     the least loaded one's by more than `balance_abs` requests and by more than `balance_rel`
///     times (SGLang's router's rule). Load (prefillLoad): queued + running at the last poll, or
///     the router's own requests awaiting an answer when more.
///   power_of_two: the less loaded of two distinct candidates drawn at random.
///   least_queued_tokens: fewest queued tokens (polled + sent), then fewest requests.
///   round_robin: each worker in turn.
///   auto (the configuration default): cache_aware with more than one prefill worker (or a
///     service), least_queued_tokens otherwise.
/// Decode:
///   most_free_blocks: most free KV blocks (polled, less the blocks of what was sent), then fewest
///     running sequences.
///   decode affinity (the router's decode policy): the decode worker the conversation's previous
///     turn went to — the deepest block of the prompt's prefix hash chain recorded for a worker —
///     while it has room for the prompt; otherwise most_free_blocks. Bounded LRU of recorded keys.
///
/// Every choice names its reason (pdserve_router_routing_decisions_total{role,reason}).
/// Ties go to the first candidate (candidates come ordered by address).
///
/// Thread rules: thread-safe; choose() may run on many threads at once.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>

#include "pd/common/generation.h"
#include "pd/common/result.h"
#include "pd/router/prefix_index.h"
#include "pd/router/worker_registry.h"

namespace pd::router {

/// What a policy may know of the request it routes.
struct RouteRequest {
  std::span<const TokenId> prompt;  ///< the tokens to prefill
};

struct RouteChoice {
  std::size_t index = 0;    ///< in the candidates
  std::string_view reason;  ///< a static label: cache_hit, least_load, imbalance, power_of_two, ...
  /// The tokens the chosen worker is expected to compute (cache_aware: the uncached ones); -1: the
  /// whole prompt. The router counts them as waiting there until the worker answers.
  std::int64_t work_tokens = -1;
};

class WorkerPolicy {
 public:
  WorkerPolicy() = default;
  virtual ~WorkerPolicy() = default;
  WorkerPolicy(const WorkerPolicy&) = delete;
  WorkerPolicy& operator=(const WorkerPolicy&) = delete;
  WorkerPolicy(WorkerPolicy&&) = delete;
  WorkerPolicy& operator=(WorkerPolicy&&) = delete;
  /// The worker to use among `candidates` (not empty), and why.
  [[nodiscard]] virtual RouteChoice choose(std::span<const WorkerView> candidates, const RouteRequest& request) = 0;
};

struct CacheAwareOptions {
  std::int64_t balance_abs = 32;  ///< requests; see the file comment
  double balance_rel = 1.5;
};

/// A prefill worker's load as cache_aware and power_of_two count it, in requests.
[[nodiscard]] std::int64_t prefillLoad(const WorkerView& w);
/// The prompt tokens waiting at a prefill worker: queued at the last poll, or the router's own
/// requests' tokens awaiting an answer when more.
[[nodiscard]] std::int64_t prefillTokenLoad(const WorkerView& w);

[[nodiscard]] std::unique_ptr<WorkerPolicy> makeLeastQueuedTokensPolicy();
[[nodiscard]] std::unique_ptr<WorkerPolicy> makeRoundRobinPolicy();
/// `seed` makes the draws reproducible (tests).
[[nodiscard]] std::unique_ptr<WorkerPolicy> makePowerOfTwoPolicy(std::uint64_t seed);
/// `index` must outlive the policy.
[[nodiscard]] std::unique_ptr<WorkerPolicy> makeCacheAwarePolicy(const PrefixIndex& index, CacheAwareOptions options);
[[nodiscard]] std::unique_ptr<WorkerPolicy> makeMostFreeBlocksPolicy();
/// Decode affinity over most_free_blocks, remembering at most `max_entries` (> 0) conversations.
[[nodiscard]] std::unique_ptr<WorkerPolicy> makeDecodeAffinityPolicy(std::size_t max_entries);

/// The policy `name` names after resolvePrefillPolicy(): least_queued_tokens, round_robin,
/// power_of_two or cache_aware (which needs `index`); InvalidArgument otherwise.
[[nodiscard]] Result<std::unique_ptr<WorkerPolicy>> makePrefillPolicy(std::string_view name,
                                                                      const PrefixIndex* index = nullptr,
                                                                      CacheAwareOptions options = {});
/// Whether `name` is a prefill policy the configuration accepts (auto included).
[[nodiscard]] bool isPrefillPolicy(std::string_view name);

}  // namespace pd::router
