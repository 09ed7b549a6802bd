#include "pd/router/prefix_index.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <utility>

#include "pd/common/check.h"
#include "pd/common/prefix_hash.h"

namespace pd::router {
namespace {

/// An instance id goes back into the next read's query string: letters, digits, '-' and '_' only.
bool plainId(std::string_view id) {
  return !id.empty() && id.size() <= 64 && std::ranges::all_of(id, [](char c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '-' || c == '_';
  });
}

}  // namespace

PrefixIndex::PrefixIndex(std::int64_t max_blocks_per_worker, metrics::Registry* metrics)
    : max_blocks_(max_blocks_per_worker), metrics_(metrics) {
  PD_CHECK(max_blocks_ > 0);
}

PrefixIndex::Cursor PrefixIndex::cursor(const std::string& worker) const {
  std::lock_guard lock(mu_);
  const auto it = workers_.find(worker);
  if (it == workers_.end()) return {};
  return Cursor{it->second.instance, it->second.seq};
}

Status PrefixIndex::apply(const std::string& worker, const worker_api::KvEvents& events) {
  std::lock_guard lock(mu_);
  const auto refuse = [&](std::string why) -> Status {
    forgetLocked(worker);
    if (metrics_ != nullptr) {
      metrics_
          ->counter("pdserve_router_kv_events_total", "KV event answers of prefill workers, by outcome.", {"outcome"})
          .labels({"refused"})
          .inc();
    }
    return makeError(ErrorCode::Corrupt, fmt::format("kv events of {}: {}", worker, why));
  };
  if (!plainId(events.instance_id)) return refuse("instance_id is not a plain id of at most 64 characters");
  const auto total = static_cast<std::int64_t>(events.blocks.size());
  if (events.snapshot) {
    if (total > max_blocks_) return refuse(fmt::format("a snapshot of {} blocks (at most {})", total, max_blocks_));
    Worker w;
    w.instance = events.instance_id;
    w.seq = events.seq;
    w.model_hash = events.model_hash;
    w.block_size = events.block_size;
    w.blocks.insert(events.blocks.begin(), events.blocks.end());
    workers_[worker] = std::move(w);
  } else {
    const auto it = workers_.find(worker);
    if (it == workers_.end() || it->second.instance != events.instance_id) {
      return refuse("events of an instance the index does not follow");
    }
    Worker& w = it->second;
    if (events.model_hash != w.model_hash || events.block_size != w.block_size) {
      return refuse("the chain's root or block size changed");
    }
    const std::uint64_t first = events.events.empty() ? events.seq : events.events.front().seq - 1;
    if (first != w.seq) return refuse(fmt::format("events continue {} but the index stands at {}", first, w.seq));
    for (const worker_api::KvEvent& e : events.events) {
      if (e.stored) {
        w.blocks.insert(e.block);
      } else {
        w.blocks.erase(e.block);
      }
      if (static_cast<std::int64_t>(w.blocks.size()) > max_blocks_) {
        return refuse(fmt::format("more than {} blocks", max_blocks_));
      }
    }
    w.seq = events.seq;
  }
  if (metrics_ != nullptr) {
    metrics_->counter("pdserve_router_kv_events_total", "KV event answers of prefill workers, by outcome.", {"outcome"})
        .labels({events.snapshot ? "snapshot" : "events"})
        .inc();
  }
  publishLocked(worker);
  return okStatus();
}

void PrefixIndex::forget(const std::string& worker) {
  std::lock_guard lock(mu_);
  forgetLocked(worker);
}

void PrefixIndex::forgetLocked(const std::string& worker) {
  workers_.erase(worker);
  publishLocked(worker);
}

void PrefixIndex::publishLocked(const std::string& worker) {
  if (metrics_ == nullptr) return;
  const auto it = workers_.find(worker);
  metrics_
      ->gauge("pdserve_router_kv_index_blocks", "Prefix-cache blocks the router believes a prefill worker holds.",
              {"worker"})
      .labels({worker})
      .set(it == workers_.end() ? 0.0 : static_cast<double>(it->second.blocks.size()));
}

std::vector<std::int64_t> PrefixIndex::cachedTokens(std::span<const std::string> workers,
                                                    std::span<const TokenId> prompt) const {
  std::vector<std::int64_t> out(workers.size(), 0);
  // The chain roots and block sizes to hash the prompt with (one chain per distinct pair).
  std::map<std::pair<std::uint64_t, std::int64_t>, std::vector<std::uint64_t>> chains;
  {
    std::lock_guard lock(mu_);
    for (const std::string& key : workers) {
      const auto it = workers_.find(key);
      if (it != workers_.end() && !it->second.blocks.empty()) {
        chains.try_emplace({it->second.model_hash, it->second.block_size});
      }
    }
  }
  if (chains.empty()) return out;
  for (auto& [root, chain] : chains) {
    chain = prefixHashChain(root.first, prompt, root.second, static_cast<std::int64_t>(prompt.size()));
  }
  std::lock_guard lock(mu_);
  for (std::size_t i = 0; i < workers.size(); ++i) {
    const auto it = workers_.find(workers[i]);
    if (it == workers_.end()) continue;
    const Worker& w = it->second;
    const auto chain = chains.find({w.model_hash, w.block_size});
    if (chain == chains.end()) continue;  // the worker changed between the two looks: count nothing
    std::int64_t held = 0;
    for (const std::uint64_t k : chain->second) {
      if (!w.blocks.contains(k)) break;
      ++held;
    }
    out[i] = held * w.block_size;
  }
  return out;
}

std::int64_t PrefixIndex::blocks(const std::string& worker) const {
  std::lock_guard lock(mu_);
  const auto it = workers_.find(worker);
  return it == workers_.end() ? 0 : static_cast<std::int64_t>(it->second.blocks.size());
}

}  // namespace pd::router
