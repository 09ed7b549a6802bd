#include "pd/router/worker_policy.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <list>
#include <mutex>
#include <random>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "pd/common/check.h"
#include "pd/common/prefix_hash.h"

namespace pd::router {
namespace {

/// Picks the candidate with the smallest key. Ties are taken in turn (the `ties`-th call picks
/// the (ties mod n)-th of the n tied candidates), not always the first: between two status polls
/// the router's own sent counters break ties, but when every request ends before the next pick
/// (light, sequential load) a fixed "first" would send everything to one worker and leave an
/// equal one, e.g. a restarted worker, idle.
template <class Key>
std::size_t argmin(std::span<const WorkerView> candidates, std::atomic<std::size_t>& ties, Key key) {
  PD_CHECK(!candidates.empty());
  auto best_key = key(candidates[0], 0);
  std::vector<std::size_t> best{0};
  for (std::size_t i = 1; i < candidates.size(); ++i) {
    auto k = key(candidates[i], i);
    if (k < best_key) {
      best_key = k;
      best.assign(1, i);
    } else if (!(best_key < k)) {
      best.push_back(i);
    }
  }
  if (best.size() == 1) return best[0];
  return best[ties.fetch_add(1, std::memory_order_relaxed) % best.size()];
}

/// Free decode blocks less those of what the router sent since the poll.
std::int64_t freeBlocksAfterSent(const WorkerView& w) {
  const std::int64_t block = std::max<std::int64_t>(w.status.block_size, 1);
  return w.status.free_blocks - (w.sent_tokens + block - 1) / block;
}

class LeastQueuedTokensPolicy final : public WorkerPolicy {
 public:
  RouteChoice choose(std::span<const WorkerView> candidates, const RouteRequest& /*request*/) override {
    return {argmin(candidates, ties_,
                   [](const WorkerView& w, std::size_t) {
                     return std::make_tuple(w.status.queued_tokens + w.sent_tokens,
                                            w.status.queued_requests + w.status.running_requests + w.sent_requests);
                   }),
            "least_queued_tokens"};
  }

 private:
  std::atomic<std::size_t> ties_{0};
};

class RoundRobinPolicy final : public WorkerPolicy {
 public:
  RouteChoice choose(std::span<const WorkerView> candidates, const RouteRequest& /*request*/) override {
    PD_CHECK(!candidates.empty());
    return {next_.fetch_add(1, std::memory_order_relaxed) % candidates.size(), "round_robin"};
  }

 private:
  std::atomic<std::size_t> next_{0};
};

class PowerOfTwoPolicy final : public WorkerPolicy {
 public:
  explicit PowerOfTwoPolicy(std::uint64_t seed) : rng_(seed) {}
  RouteChoice choose(std::span<const WorkerView> candidates, const RouteRequest& /*request*/) override {
    PD_CHECK(!candidates.empty());
    if (candidates.size() == 1) return {0, "power_of_two"};
    std::size_t a = 0;
    std::size_t b = 0;
    {
      std::lock_guard lock(mu_);
      a = std::uniform_int_distribution<std::size_t>(0, candidates.size() - 1)(rng_);
      b = std::uniform_int_distribution<std::size_t>(0, candidates.size() - 2)(rng_);
    }
    if (b >= a) ++b;  // two distinct candidates
    return {prefillLoad(candidates[b]) < prefillLoad(candidates[a]) ? b : a, "power_of_two"};
  }

 private:
  std::mutex mu_;
  std::mt19937_64 rng_;  // guarded by mu_
};

class CacheAwarePolicy final : public WorkerPolicy {
 public:
  CacheAwarePolicy(const PrefixIndex& index, CacheAwareOptions options) : index_(index), options_(options) {}

  RouteChoice choose(std::span<const WorkerView> candidates, const RouteRequest& request) override {
    PD_CHECK(!candidates.empty());
    std::int64_t lo = prefillLoad(candidates[0]);
    std::int64_t hi = lo;
    for (const WorkerView& w : candidates) {
      lo = std::min(lo, prefillLoad(w));
      hi = std::max(hi, prefillLoad(w));
    }
    const bool imbalanced =
        hi - lo > options_.balance_abs && static_cast<double>(hi) > static_cast<double>(lo) * options_.balance_rel;
    if (imbalanced) {
      return {argmin(candidates, ties_, [](const WorkerView& w, std::size_t) { return prefillLoad(w); }), "imbalance",
              -1};
    }
    std::vector<std::string> keys;
    keys.reserve(candidates.size());
    for (const WorkerView& w : candidates) keys.push_back(w.address.key());
    const std::vector<std::int64_t> cached = index_.cachedTokens(keys, request.prompt);
    // Balanced against load: the least work before this prompt's first token, its uncached tokens
    // plus the tokens already waiting there (as Dynamo's KV router weighs overlap against load),
    // then the fewest requests.
    const auto prompt = static_cast<std::int64_t>(request.prompt.size());
    const std::size_t best = argmin(candidates, ties_, [&](const WorkerView& w, std::size_t i) {
      return std::make_tuple(prompt - cached[i] + prefillTokenLoad(w), prefillLoad(w));
    });
    return {best, cached[best] > 0 ? "cache_hit" : "least_load", prompt - cached[best]};
  }

 private:
  const PrefixIndex& index_;
  const CacheAwareOptions options_;
  std::atomic<std::size_t> ties_{0};
};

class MostFreeBlocksPolicy final : public WorkerPolicy {
 public:
  RouteChoice choose(std::span<const WorkerView> candidates, const RouteRequest& /*request*/) override {
    return {argmin(candidates, ties_,
                   [](const WorkerView& w, std::size_t) {
                     return std::make_tuple(-freeBlocksAfterSent(w),
                                            w.status.running_requests + w.status.queued_requests + w.sent_requests);
                   }),
            "most_free_blocks"};
  }

 private:
  std::atomic<std::size_t> ties_{0};
};

class DecodeAffinityPolicy final : public WorkerPolicy {
 public:
  explicit DecodeAffinityPolicy(std::size_t max_entries) : max_entries_(max_entries) { PD_CHECK(max_entries_ > 0); }

  RouteChoice choose(std::span<const WorkerView> candidates, const RouteRequest& request) override {
    PD_CHECK(!candidates.empty());
    const std::int64_t block = std::max<std::int64_t>(candidates[0].status.block_size, 1);
    // Root 0: the key space is the router's own (the decode workers do not publish events).
    const std::vector<std::uint64_t> chain =
        prefixHashChain(0, request.prompt, block, static_cast<std::int64_t>(request.prompt.size()));
    const std::int64_t prompt_blocks = (static_cast<std::int64_t>(request.prompt.size()) + block - 1) / block;
    RouteChoice choice;
    bool found = false;
    std::lock_guard lock(mu_);
    for (auto it = chain.rbegin(); it != chain.rend() && !found; ++it) {
      const auto hit = entries_.find(*it);
      if (hit == entries_.end()) continue;
      for (std::size_t i = 0; i < candidates.size(); ++i) {
        // The conversation's worker, while it has room for the prompt and a block to grow.
        if (candidates[i].address.key() == hit->second.worker && freeBlocksAfterSent(candidates[i]) > prompt_blocks) {
          choice = {i, "affinity"};
          found = true;
        }
      }
      break;  // only the deepest recorded prefix names the conversation's worker
    }
    if (!found) choice = fallback_.choose(candidates, request);
    if (!chain.empty()) recordLocked(chain.back(), candidates[choice.index].address.key());
    return choice;
  }

 private:
  struct Entry {
    std::string worker;
    std::list<std::uint64_t>::iterator lru;
  };

  void recordLocked(std::uint64_t key, const std::string& worker) {
    if (auto it = entries_.find(key); it != entries_.end()) {
      lru_.erase(it->second.lru);
      entries_.erase(it);
    }
    lru_.push_back(key);
    entries_.emplace(key, Entry{worker, std::prev(lru_.end())});
    while (entries_.size() > max_entries_) {
      entries_.erase(lru_.front());
      lru_.pop_front();
    }
  }

  const std::size_t max_entries_;
  MostFreeBlocksPolicy fallback_;
  std::mutex mu_;
  std::unordered_map<std::uint64_t, Entry> entries_;  // guarded by mu_
  std::list<std::uint64_t> lru_;                      // guarded by mu_: least recently recorded first
};

}  // namespace

std::int64_t prefillTokenLoad(const WorkerView& w) {
  return std::max(w.status.queued_tokens, w.in_flight_tokens);
}

std::int64_t prefillLoad(const WorkerView& w) {
  // The poll (every router's load) or this router's own requests awaiting an answer, whichever is
  // more: exact for this router's requests between polls, and not stale once they are answered
  // (what was sent since the poll would be, until the next poll).
  return std::max(w.status.queued_requests + w.status.running_requests, w.in_flight);
}

std::unique_ptr<WorkerPolicy> makeLeastQueuedTokensPolicy() {
  return std::make_unique<LeastQueuedTokensPolicy>();
}
std::unique_ptr<WorkerPolicy> makeRoundRobinPolicy() {
  return std::make_unique<RoundRobinPolicy>();
}
std::unique_ptr<WorkerPolicy> makePowerOfTwoPolicy(std::uint64_t seed) {
  return std::make_unique<PowerOfTwoPolicy>(seed);
}
std::unique_ptr<WorkerPolicy> makeCacheAwarePolicy(const PrefixIndex& index, CacheAwareOptions options) {
  return std::make_unique<CacheAwarePolicy>(index, options);
}
std::unique_ptr<WorkerPolicy> makeMostFreeBlocksPolicy() {
  return std::make_unique<MostFreeBlocksPolicy>();
}
std::unique_ptr<WorkerPolicy> makeDecodeAffinityPolicy(std::size_t max_entries) {
  return std::make_unique<DecodeAffinityPolicy>(max_entries);
}

bool isPrefillPolicy(std::string_view name) {
  return name == "auto" || name == "cache_aware" || name == "power_of_two" || name == "least_queued_tokens" ||
         name == "round_robin";
}

Result<std::unique_ptr<WorkerPolicy>> makePrefillPolicy(std::string_view name, const PrefixIndex* index,
                                                        CacheAwareOptions options) {
  if (name == "least_queued_tokens") return makeLeastQueuedTokensPolicy();
  if (name == "round_robin") return makeRoundRobinPolicy();
  if (name == "power_of_two") return makePowerOfTwoPolicy(std::random_device{}());
  if (name == "cache_aware") {
    if (index == nullptr) return makeError(ErrorCode::InvalidArgument, "cache_aware needs the KV event index");
    return makeCacheAwarePolicy(*index, options);
  }
  return makeError(
      ErrorCode::InvalidArgument,
      fmt::format("unknown prefill policy '{}' (cache_aware, power_of_two, least_queued_tokens or round_robin)", name));
}

}  // namespace pd::router
