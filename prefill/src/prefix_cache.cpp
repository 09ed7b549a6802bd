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

std::uint64_t PrefixCache::find(std::uint64_t key, std::uint64_t parent, std::span<const std::int32_t> block,
                                std::int32_t next) const {
  const auto it = by_key_.find(key);
  if (it == by_key_.end()) return 0;
  for (const std::uint64_t id : it->second) {
    const Entry& e = entries_.at(id);
    if (e.parent == parent && e.next == next && std::ranges::equal(e.tokens, block)) return id;
  }
  return 0;
}

bool PrefixCache::collides(std::uint64_t key, std::uint64_t parent, std::span<const std::int32_t> block) const {
  const auto it = by_key_.find(key);
  if (it == by_key_.end()) return false;
  return std::ranges::any_of(it->second, [&](std::uint64_t id) {
    const Entry& e = entries_.at(id);
    return e.parent != parent || !std::ranges::equal(e.tokens, block);
  });
}

void PrefixCache::erase(std::uint64_t id) {
  const auto it = entries_.find(id);
  const std::uint64_t key = it->second.key;
  entries_.erase(it);
  auto& variants = by_key_.at(key);
  std::erase(variants, id);
  if (variants.empty()) {
    by_key_.erase(key);
    if (events_ != nullptr) events_->removed(key);
  }
  evictions_ += 1;
}

std::vector<PrefixCache::Hit> PrefixCache::acquire(std::span<const std::int32_t> tokens, std::int64_t max_blocks) {
  std::vector<Hit> hits;
  // Only blocks followed by a token: that token selects the variant.
  const std::int64_t followed = tokens.empty() ? 0 : static_cast<std::int64_t>(tokens.size() - 1) / block_size_;
  const std::vector<std::uint64_t> keys = chain(model_hash_, tokens, block_size_, std::min(max_blocks, followed));
  const auto b = static_cast<std::size_t>(block_size_);
  std::uint64_t parent = model_hash_;
  for (std::size_t i = 0; i < keys.size(); ++i) {
    const std::uint64_t id = find(keys[i], parent, tokens.subspan(i * b, b), tokens[(i + 1) * b]);
    if (id == 0) break;
    Entry& e = entries_.at(id);
    if (e.refs++ == 0) idle_.erase(e.lru);
    hits.push_back(Hit{id, e.block});
    parent = keys[i];
  }
  return hits;
}

void PrefixCache::release(std::span<const std::uint64_t> entries) {
  // Deepest first, so that the chain's root ends most recently used and leaves are evicted first.
  for (auto it = entries.rbegin(); it != entries.rend(); ++it) {
    Entry& e = entries_.at(*it);
    if (--e.refs == 0) e.lru = idle_.insert(idle_.end(), *it);
  }
}

std::vector<std::int32_t> PrefixCache::insert(std::span<const std::int32_t> tokens, std::int64_t first_block,
                                              std::span<const std::int32_t> blocks) {
  std::vector<std::int32_t> refused;
  const auto b = static_cast<std::size_t>(block_size_);
  const std::int64_t followed = tokens.empty() ? 0 : static_cast<std::int64_t>(tokens.size() - 1) / block_size_;
  const auto full = std::min(followed, first_block + static_cast<std::int64_t>(blocks.size()));
  const std::vector<std::uint64_t> keys = chain(model_hash_, tokens, block_size_, full);
  const auto parent_of = [&](std::int64_t i) { return i == 0 ? model_hash_ : keys[static_cast<std::size_t>(i - 1)]; };
  const auto tokens_of = [&](std::int64_t i) { return tokens.subspan(static_cast<std::size_t>(i) * b, b); };
  const auto next_of = [&](std::int64_t i) { return tokens[static_cast<std::size_t>(i + 1) * b]; };
  std::vector<std::uint64_t> taken;
  bool chained = true;  // every block before i is cached with its next token, so block i is reachable
  for (std::int64_t i = 0; i < first_block && i < full; ++i) {
    chained = chained && find(keys[static_cast<std::size_t>(i)], parent_of(i), tokens_of(i), next_of(i)) != 0;
  }
  for (std::int64_t i = first_block; i < first_block + static_cast<std::int64_t>(blocks.size()); ++i) {
    const std::int32_t block = blocks[static_cast<std::size_t>(i - first_block)];
    if (i >= full || !chained) {
      refused.push_back(block);
      chained = false;
      continue;
    }
    const std::uint64_t key = keys[static_cast<std::size_t>(i)];
    if (collides(key, parent_of(i), tokens_of(i))) {  // the key is another prefix's: not ours to extend
      refused.push_back(block);
      chained = false;
      continue;
    }
    if (find(key, parent_of(i), tokens_of(i), next_of(i)) != 0) {  // cached already (a concurrent twin)
      refused.push_back(block);
      continue;
    }
    if (static_cast<std::int64_t>(entries_.size()) >= capacity_) {
      // Displace the least recently used idle block, but never one of this prompt's own chain.
      const auto victim = std::ranges::find_if(
          idle_, [&](std::uint64_t id) { return std::ranges::find(keys, entries_.at(id).key) == keys.end(); });
      if (victim == idle_.end()) {
        refused.push_back(block);
        chained = false;
        continue;
      }
      const std::uint64_t id = *victim;
      idle_.erase(victim);
      refused.push_back(entries_.at(id).block);
      erase(id);
    }
    Entry e;
    e.key = key;
    e.parent = parent_of(i);
    const auto own = tokens_of(i);
    e.tokens.assign(own.begin(), own.end());
    e.next = next_of(i);
    e.block = block;
    const std::uint64_t id = next_id_++;
    entries_.emplace(id, std::move(e));
    auto& variants = by_key_[key];
    variants.push_back(id);
    if (variants.size() == 1 && events_ != nullptr) events_->stored(key);
    taken.push_back(id);
  }
  // New blocks start idle, the chain's root most recently used (as release() orders them).
  for (auto it = taken.rbegin(); it != taken.rend(); ++it) entries_.at(*it).lru = idle_.insert(idle_.end(), *it);
  return refused;
}

std::vector<std::int32_t> PrefixCache::evict(std::int64_t n) {
  std::vector<std::int32_t> freed;
  while (n-- > 0 && !idle_.empty()) {
    const std::uint64_t id = idle_.front();
    idle_.pop_front();
    freed.push_back(entries_.at(id).block);
    erase(id);
  }
  return freed;
}

PrefixCacheStats PrefixCache::stats() const {
  return PrefixCacheStats{static_cast<std::int64_t>(entries_.size()), static_cast<std::int64_t>(idle_.size()),
                          evictions_};
}

}  // namespace pd::prefill
