#include "pd/router/worker_policy.h"

#include <fmt/format.h>

#include <atomic>
#include <tuple>

#include "pd/common/check.h"

namespace pd::router {
namespace {

/// Picks the candidate with the smallest key (first on ties).
template <class Key>
std::size_t argmin(std::span<const WorkerView> candidates, Key key) {
  PD_CHECK(!candidates.empty());
  std::size_t best = 0;
  auto best_key = key(candidates[0]);
  for (std::size_t i = 1; i < candidates.size(); ++i) {
    auto k = key(candidates[i]);
    if (k < best_key) {
      best = i;
      best_key = k;
    }
  }
  return best;
}

class LeastQueuedTokensPolicy final : public WorkerPolicy {
 public:
  std::size_t choose(std::span<const WorkerView> candidates) override {
    return argmin(candidates, [](const WorkerView& w) {
      return std::make_tuple(w.status.queued_tokens + w.sent_tokens,
                             w.status.queued_requests + w.status.running_requests + w.sent_requests);
    });
  }
};

class RoundRobinPolicy final : public WorkerPolicy {
 public:
  std::size_t choose(std::span<const WorkerView> candidates) override {
    PD_CHECK(!candidates.empty());
    return next_.fetch_add(1, std::memory_order_relaxed) % candidates.size();
  }

 private:
  std::atomic<std::size_t> next_{0};
};

class MostFreeBlocksPolicy final : public WorkerPolicy {
 public:
  std::size_t choose(std::span<const WorkerView> candidates) override {
    return argmin(candidates, [](const WorkerView& w) {
      const std::int64_t block = std::max<std::int64_t>(w.status.block_size, 1);
      const std::int64_t sent_blocks = (w.sent_tokens + block - 1) / block;
      return std::make_tuple(-(w.status.free_blocks - sent_blocks),
                             w.status.running_requests + w.status.queued_requests + w.sent_requests);
    });
  }
};

}  // namespace

std::unique_ptr<WorkerPolicy> makeLeastQueuedTokensPolicy() {
  return std::make_unique<LeastQueuedTokensPolicy>();
}
std::unique_ptr<WorkerPolicy> makeRoundRobinPolicy() {
  return std::make_unique<RoundRobinPolicy>();
}
std::unique_ptr<WorkerPolicy> makeMostFreeBlocksPolicy() {
  return std::make_unique<MostFreeBlocksPolicy>();
}

Result<std::unique_ptr<WorkerPolicy>> makePrefillPolicy(std::string_view name) {
  if (name == "least_queued_tokens") return makeLeastQueuedTokensPolicy();
  if (name == "round_robin") return makeRoundRobinPolicy();
  return makeError(ErrorCode::InvalidArgument,
                   fmt::format("unknown prefill policy '{}' (least_queued_tokens or round_robin)", name));
}

}  // namespace pd::router
