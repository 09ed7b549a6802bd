#pragma once
/// The router's index of what each prefill worker's prefix cache holds (docs/routing.md), learnt
/// from the KV events the workers publish (GET /v1/internal/kv_events, worker_api::KvEvents), so
/// that the cache_aware policy can send a prompt where its longest prefix is cached.
///
/// Per worker: the instance it follows, the last event number applied, the hash chain's root and
/// block size, and the set of block keys held. A snapshot replaces the set; events must continue
/// the same instance exactly where the index stands (the next number, the same root and block
/// size), else the answer is refused and the worker forgotten, so its next read asks for a
/// snapshot. A new instance id (the worker restarted) therefore always starts from an empty index
/// plus its snapshot. Memory is bounded: a worker claiming more than `max_blocks_per_worker`
/// blocks is refused and forgotten.
///
/// The index only ranks candidates the registry already put in rotation: stale or lost events can
/// cost a cache miss, never a request sent to a worker that is out of rotation.
///
/// Thread rules: thread-safe (one mutex; prompt hashing runs outside it).

#include <cstdint>
#include <mutex>
#include <span>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "pd/common/generation.h"
#include "pd/common/metrics.h"
#include "pd/common/result.h"
#include "pd/common/worker_api.h"

namespace pd::router {

class PrefixIndex {
 public:
  /// Where the next read of a worker's events starts (its query: after=, instance=).
  struct Cursor {
    std::string instance;  ///< empty: the index knows nothing of the worker (a snapshot comes)
    std::uint64_t after = 0;
  };

  /// `max_blocks_per_worker` > 0. `metrics` (may be null, must outlive the index):
  /// pdserve_router_kv_index_blocks{worker} and pdserve_router_kv_events_total{outcome}
  /// (events, snapshot, refused).
  explicit PrefixIndex(std::int64_t max_blocks_per_worker, metrics::Registry* metrics = nullptr);
  PrefixIndex(const PrefixIndex&) = delete;
  PrefixIndex& operator=(const PrefixIndex&) = delete;
  PrefixIndex(PrefixIndex&&) = delete;
  PrefixIndex& operator=(PrefixIndex&&) = delete;
  ~PrefixIndex() = default;

  [[nodiscard]] Cursor cursor(const std::string& worker) const;
  /// Applies one answer of `worker` (parsed by worker_api::parseKvEvents). Corrupt when it does
  /// not continue the index (see the file comment); the worker is then forgotten.
  [[nodiscard]] Status apply(const std::string& worker, const worker_api::KvEvents& events);
  /// Drops everything known of `worker`.
  void forget(const std::string& worker);

  /// For each of `workers`, the tokens of `prompt`'s longest leading run of full blocks that the
  /// worker holds (0 for a worker the index does not know).
  [[nodiscard]] std::vector<std::int64_t> cachedTokens(std::span<const std::string> workers,
                                                       std::span<const TokenId> prompt) const;
  /// Blocks held by `worker` as far as the index knows.
  [[nodiscard]] std::int64_t blocks(const std::string& worker) const;

 private:
  struct Worker {
    std::string instance;
    std::uint64_t seq = 0;
    std::uint64_t model_hash = 0;
    std::int64_t block_size = 0;
    std::unordered_set<std::uint64_t> blocks;
  };
  void publishLocked(const std::string& worker);
  void forgetLocked(const std::string& worker);

  const std::int64_t max_blocks_;
  metrics::Registry* const metrics_;
  mutable std::mutex mu_;
  std::unordered_map<std::string, Worker> workers_;  // guarded by mu_
};

}  // namespace pd::router
