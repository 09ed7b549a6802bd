#include "pd/prefill/prefix_cache.h"

#include <algorithm>
#include <utility>

#include "pd/common/prefix_hash.h"

namespace pd::prefill {

PrefixCache::PrefixCache(std::int64_t capacity_blocks, std::int64_t block_size, std::uint64_t model_hash,
                         KvEventLog* events)
    : capacity_(capacity_blocks), block_size_(block_size), model_hash_(model_hash), events_(events) {}

std::vector<std::uint64_t> PrefixCache::chain(std::uint64_t model_hash, std::span<const std::int32_t> tokens,
                                              std::int64_t block_size, std::int64_t max_blocks) {
  return prefixHashChain(model_hash, tokens, block_size, max_blocks);
}

const PrefixCache::Entry* PrefixCache::find(std::uint64_t key, std::uint64_t parent,
                                            std::span<const std::int32_t> block) const {
  const auto it = entries_.find(key);
  if (it == entries_.end()) return nullptr;
  const Entry& e = it->second;
  if (e.parent != parent || !std::ranges::equal(e.tokens, block)) return nullptr;  // a hash collision
  return &e;
}

std::vector<PrefixCache::Hit> PrefixCache::acquire(std::span<const std::int32_t> tokens, std::int64_t max_blocks) {
  std::vector<Hit> hits;
  const std::vector<std::uint64_t> keys = chain(model_hash_, tokens, block_size_, max_blocks);
  std::uint64_t parent = model_hash_;
  for (std::size_t i = 0; i < keys.size(); ++i) {
    const auto block = tokens.subspan(i * static_cast<std::size_t>(block_size_), static_cast<std::size_t>(block_size_));
    if (find(keys[i], parent, block) == nullptr) break;
    Entry& e = entries_.at(keys[i]);
    if (e.refs++ == 0) idle_.erase(e.lru);
    hits.push_back(Hit{keys[i], e.block, e.payload});
    parent = keys[i];
  }
  return hits;
}

void PrefixCache::release(std::span<const std::uint64_t> keys) {
  // Deepest first, so that the chain's root ends most recently used and leaves are evicted first.
  for (auto it = keys.rbegin(); it != keys.rend(); ++it) {
    Entry& e = entries_.at(*it);
    if (--e.refs == 0) e.lru = idle_.insert(idle_.end(), *it);
  }
}

std::vector<std::int32_t> PrefixCache::insert(std::span<const std::int32_t> tokens, std::int64_t first_block,
                                              std::span<const std::int32_t> blocks,
                                              std::vector<std::vector<float>> payloads) {
  std::vector<std::int32_t> refused;
  const auto full = std::min(static_cast<std::int64_t>(tokens.size()) / block_size_,
                             first_block + static_cast<std::int64_t>(blocks.size()));
  const std::vector<std::uint64_t> keys = chain(model_hash_, tokens, block_size_, full);
  std::vector<std::uint64_t> taken;
  bool chained = true;  // every block before i is cached, so block i is reachable
  for (std::int64_t i = 0; i < first_block && i < full; ++i) {
    chained = chained && entries_.contains(keys[static_cast<std::size_t>(i)]);
  }
  for (std::int64_t i = first_block; i < first_block + static_cast<std::int64_t>(blocks.size()); ++i) {
    const std::int32_t block = blocks[static_cast<std::size_t>(i - first_block)];
    const bool is_full = i < full;
    const std::uint64_t key = is_full ? keys[static_cast<std::size_t>(i)] : 0;
    if (!is_full || !chained || entries_.contains(key)) {
      refused.push_back(block);
      // A block already cached under its key keeps the chain going only if it holds these tokens.
      if (is_full && chained && entries_.contains(key)) {
        const std::uint64_t parent = i == 0 ? model_hash_ : keys[static_cast<std::size_t>(i - 1)];
        chained = find(key, parent,
                       tokens.subspan(static_cast<std::size_t>(i * block_size_),
                                      static_cast<std::size_t>(block_size_))) != nullptr;
      } else {
        chained = false;
      }
      continue;
    }
    if (static_cast<std::int64_t>(entries_.size()) >= capacity_) {
      // Displace the least recently used idle block, but never one of this prompt's own chain.
      auto victim =
          std::ranges::find_if(idle_, [&](std::uint64_t k) { return std::ranges::find(keys, k) == keys.end(); });
      if (victim == idle_.end()) {
        refused.push_back(block);
        chained = false;
        continue;
      }
      refused.push_back(entries_.at(*victim).block);
      if (events_ != nullptr) events_->removed(*victim);
      entries_.erase(*victim);
      idle_.erase(victim);
      evictions_ += 1;
    }
    Entry e;
    e.parent = i == 0 ? model_hash_ : keys[static_cast<std::size_t>(i - 1)];
    e.tokens.assign(tokens.begin() + i * block_size_, tokens.begin() + (i + 1) * block_size_);
    e.block = block;
    const auto p = static_cast<std::size_t>(i - first_block);
    if (p < payloads.size()) e.payload = std::move(payloads[p]);
    entries_.emplace(key, std::move(e));
    if (events_ != nullptr) events_->stored(key);
    taken.push_back(key);
  }
  // New blocks start idle, the chain's root most recently used (as release() orders them).
  for (auto it = taken.rbegin(); it != taken.rend(); ++it) entries_.at(*it).lru = idle_.insert(idle_.end(), *it);
  return refused;
}

std::vector<std::int32_t> PrefixCache::evict(std::int64_t n) {
  std::vector<std::int32_t> freed;
  while (n-- > 0 && !idle_.empty()) {
    const std::uint64_t key = idle_.front();
    idle_.pop_front();
    freed.push_back(entries_.at(key).block);
    if (events_ != nullptr) events_->removed(key);
    entries_.erase(key);
    evictions_ += 1;
  }
  return freed;
}

PrefixCacheStats PrefixCache::stats() const {
  return PrefixCacheStats{static_cast<std::int64_t>(entries_.size()), static_cast<std::int64_t>(idle_.size()),
                          evictions_};
}

}  // namespace pd::prefill
