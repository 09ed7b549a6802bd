#include "pd/decode/kv_block_manager.h"

#include <fmt/format.h>

#include <algorithm>

#include "pd/common/prefix_hash.h"

namespace pd::decode {

KvBlockManager::KvBlockManager(std::int64_t num_blocks, std::int64_t block_size, std::int64_t headroom_blocks,
                               std::int64_t prefix_cache_blocks, std::uint64_t model_hash)
    : num_blocks_(num_blocks),
      block_size_(block_size),
      headroom_blocks_(headroom_blocks),
      prefix_capacity_(prefix_cache_blocks),
      model_hash_(model_hash) {
  PD_CHECK(num_blocks > 0 && block_size > 0 && prefix_cache_blocks >= 0);
  PD_CHECK(num_blocks <= INT32_MAX);
  PD_CHECK(headroom_blocks >= 0 && headroom_blocks < num_blocks);
  free_.reserve(static_cast<std::size_t>(num_blocks));
  // Pushed in reverse so that a fresh pool hands out block 0 first.
  for (std::int64_t b = num_blocks - 1; b >= 0; --b) free_.push_back(static_cast<std::int32_t>(b));
  refs_.assign(static_cast<std::size_t>(num_blocks), 0);
  qrefs_.assign(static_cast<std::size_t>(num_blocks), 0);
  cached_.resize(static_cast<std::size_t>(num_blocks));
  in_cache_.assign(static_cast<std::size_t>(num_blocks), false);
  idle_pos_.resize(static_cast<std::size_t>(num_blocks));
}

std::int64_t KvBlockManager::blocksFor(std::int64_t tokens) const {
  return std::max<std::int64_t>(1, (tokens + block_size_ - 1) / block_size_);
}

std::int64_t KvBlockManager::availableBlocks() const {
  return std::max<std::int64_t>(0, freeBlocks() - headroom_blocks_);
}

std::int32_t KvBlockManager::refCount(std::int32_t block) const {
  PD_CHECK(block >= 0 && block < num_blocks_);
  return refs_[static_cast<std::size_t>(block)];
}

template <typename Change>
void KvBlockManager::recount(std::int32_t b, Change change) {
  const auto i = static_cast<std::size_t>(b);
  const auto quarantined = [&] { return refs_[i] > 0 && qrefs_[i] == refs_[i]; };
  const bool was_quarantined = quarantined();
  const bool was_shared = refs_[i] > 1;
  const bool was_idle = in_cache_[i] && refs_[i] == 1;
  change(refs_[i], qrefs_[i]);
  PD_CHECK(refs_[i] >= 0 && qrefs_[i] >= 0 && qrefs_[i] <= refs_[i]);
  const bool idle = in_cache_[i] && refs_[i] == 1;
  // A cached block whose last request lets go becomes the most recently used idle block.
  if (was_idle && !idle) idle_.erase(idle_pos_[i]);
  if (idle && !was_idle) idle_pos_[i] = idle_.insert(idle_.end(), b);
  quarantined_blocks_ += static_cast<std::int64_t>(quarantined()) - static_cast<std::int64_t>(was_quarantined);
  shared_blocks_ += static_cast<std::int64_t>(refs_[i] > 1) - static_cast<std::int64_t>(was_shared);
}

void KvBlockManager::evictOne() {
  PD_CHECK(!idle_.empty());
  const std::int32_t b = idle_.front();
  const auto i = static_cast<std::size_t>(b);
  auto& variants = by_key_.at(cached_[i].key);
  std::erase(variants, b);
  if (variants.empty()) by_key_.erase(cached_[i].key);
  cached_[i] = CachedBlock{};
  --cached_blocks_;
  // Out of the cache first: the drop below then frees the block instead of idling it.
  idle_.pop_front();
  in_cache_[i] = false;
  ++prefix_evictions_;
  dropRef(b, false);
}

std::int32_t KvBlockManager::take() {
  if (free_.empty()) evictOne();
  PD_CHECK(!free_.empty());
  const std::int32_t b = free_.back();
  free_.pop_back();
  PD_CHECK(refs_[static_cast<std::size_t>(b)] == 0);
  recount(b, [](std::int32_t& refs, std::int32_t&) { refs = 1; });
  if (on_take_) on_take_(b);
  return b;
}

void KvBlockManager::addRef(std::int32_t b, bool quarantined) {
  recount(b, [quarantined](std::int32_t& refs, std::int32_t& qrefs) {
    ++refs;
    if (quarantined) ++qrefs;
  });
}

void KvBlockManager::dropRef(std::int32_t b, bool quarantined) {
  recount(b, [quarantined](std::int32_t& refs, std::int32_t& qrefs) {
    --refs;
    if (quarantined) --qrefs;
  });
  if (refs_[static_cast<std::size_t>(b)] == 0) free_.push_back(b);
}

Status KvBlockManager::admit(std::uint64_t request_id, std::int64_t prompt_tokens, std::int64_t spare_blocks,
                             std::span<const std::int32_t> shared_prefix) {
  if (prompt_tokens <= 0 || spare_blocks < 0) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("request {}: prompt_tokens {} must be positive and spare blocks {} not negative",
                                 request_id, prompt_tokens, spare_blocks));
  }
  if (requests_.contains(request_id)) {
    return makeError(ErrorCode::InvalidArgument, fmt::format("request {} is already admitted", request_id));
  }
  const std::int64_t prompt_blocks = blocksFor(prompt_tokens);
  const auto shared = static_cast<std::int64_t>(shared_prefix.size());
  if (shared >= prompt_blocks || std::any_of(shared_prefix.begin(), shared_prefix.end(), [this](std::int32_t b) {
        return b < 0 || b >= num_blocks_ || !in_cache_[static_cast<std::size_t>(b)];
      })) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("request {}: {} shared prefix blocks for a {}-block prompt, or one not cached",
                                 request_id, shared, prompt_blocks));
  }
  const std::int64_t need = prompt_blocks + spare_blocks;
  if (need > num_blocks_) {
    return makeError(ErrorCode::ResourceExhausted,
                     fmt::format("request {} needs {} KV blocks for its {}-token prompt ({} of them for its choices) "
                                 "but the pool has only {}",
                                 request_id, need, prompt_tokens, spare_blocks, num_blocks_));
  }
  // An idle shared block stops being free once this request holds it.
  const auto idle_shared = std::count_if(shared_prefix.begin(), shared_prefix.end(),
                                         [this](std::int32_t b) { return refs_[static_cast<std::size_t>(b)] == 1; });
  if (need - shared + idle_shared > availableBlocks()) {
    return makeError(ErrorCode::Overloaded,
                     fmt::format("request {} needs {} KV blocks; {} of {} are free ({} kept as headroom)", request_id,
                                 need - shared + idle_shared, freeBlocks(), num_blocks_, headroom_blocks_));
  }
  Entry entry;
  entry.blocks.reserve(static_cast<std::size_t>(prompt_blocks));
  // Shared blocks first: once held they are no longer idle, so take() cannot evict them.
  for (const std::int32_t b : shared_prefix) {
    addRef(b, false);
    entry.blocks.push_back(b);
  }
  for (std::int64_t i = shared; i < prompt_blocks; ++i) entry.blocks.push_back(take());
  for (std::int64_t i = 0; i < spare_blocks; ++i) entry.spares.push_back(take());
  requests_.emplace(request_id, std::move(entry));
  return okStatus();
}

Result<KvBlockManager::BlockCopy> KvBlockManager::fork(std::uint64_t parent_id, std::uint64_t child_id) {
  const auto it = requests_.find(parent_id);
  if (it == requests_.end())
    return makeError(ErrorCode::NotFound, fmt::format("request {} holds no KV blocks", parent_id));
  Entry& parent = it->second;
  if (parent.quarantined) {
    return makeError(ErrorCode::InvalidArgument, fmt::format("request {}: its blocks are quarantined", parent_id));
  }
  if (requests_.contains(child_id)) {
    return makeError(ErrorCode::InvalidArgument, fmt::format("request {} is already admitted", child_id));
  }
  if (parent.spares.empty()) {
    return makeError(ErrorCode::InvalidArgument, fmt::format("request {} has no spare block to fork", parent_id));
  }
  Entry child;
  child.blocks.reserve(parent.blocks.size());
  for (std::size_t i = 0; i + 1 < parent.blocks.size(); ++i) {
    addRef(parent.blocks[i], false);
    child.blocks.push_back(parent.blocks[i]);
  }
  // The spare's one reference moves from the parent to the child.
  const std::int32_t copy = parent.spares.back();
  parent.spares.pop_back();
  child.blocks.push_back(copy);
  const BlockCopy out{parent.blocks.back(), copy};
  requests_.emplace(child_id, std::move(child));
  return out;
}

std::int64_t KvBlockManager::releaseSpares(std::uint64_t request_id) {
  const auto it = requests_.find(request_id);
  if (it == requests_.end()) return 0;
  Entry& e = it->second;
  const auto n = static_cast<std::int64_t>(e.spares.size());
  for (auto b = e.spares.rbegin(); b != e.spares.rend(); ++b) dropRef(*b, e.quarantined);
  e.spares.clear();
  return n;
}

Status KvBlockManager::grow(std::uint64_t request_id, std::int64_t tokens) {
  const auto it = requests_.find(request_id);
  if (it == requests_.end())
    return makeError(ErrorCode::NotFound, fmt::format("request {} holds no KV blocks", request_id));
  Entry& e = it->second;
  if (e.quarantined) {
    return makeError(ErrorCode::InvalidArgument, fmt::format("request {}: its blocks are quarantined", request_id));
  }
  const std::int64_t missing = blocksFor(tokens) - static_cast<std::int64_t>(e.blocks.size());
  if (missing <= 0) return okStatus();
  if (missing > freeBlocks()) {
    return makeError(ErrorCode::Overloaded, fmt::format("request {} needs {} more KV block(s); {} are free", request_id,
                                                        missing, freeBlocks()));
  }
  for (std::int64_t i = 0; i < missing; ++i) e.blocks.push_back(take());
  return okStatus();
}

std::span<const std::int32_t> KvBlockManager::blockTable(std::uint64_t request_id) const {
  const auto it = requests_.find(request_id);
  if (it == requests_.end()) return {};
  return it->second.blocks;
}

bool KvBlockManager::release(std::uint64_t request_id) {
  const auto it = requests_.find(request_id);
  if (it == requests_.end()) return false;
  Entry& e = it->second;
  // Dropped in reverse so the next admission gets freed blocks back in the same order.
  for (auto b = e.spares.rbegin(); b != e.spares.rend(); ++b) dropRef(*b, e.quarantined);
  for (auto b = e.blocks.rbegin(); b != e.blocks.rend(); ++b) dropRef(*b, e.quarantined);
  requests_.erase(it);
  PD_CHECK(quarantined_blocks_ >= 0 && shared_blocks_ >= 0);
  return true;
}

std::int64_t KvBlockManager::quarantine(std::uint64_t request_id) {
  const auto it = requests_.find(request_id);
  if (it == requests_.end() || it->second.quarantined) return 0;
  Entry& e = it->second;
  e.quarantined = true;
  const auto mark = [this](std::int32_t b) { recount(b, [](std::int32_t&, std::int32_t& qrefs) { ++qrefs; }); };
  for (const std::int32_t b : e.blocks) mark(b);
  for (const std::int32_t b : e.spares) mark(b);
  return static_cast<std::int64_t>(e.blocks.size() + e.spares.size());
}

bool KvBlockManager::isQuarantined(std::uint64_t request_id) const {
  const auto it = requests_.find(request_id);
  return it != requests_.end() && it->second.quarantined;
}

std::int32_t KvBlockManager::findCached(std::uint64_t key, std::uint64_t parent, std::span<const std::int32_t> tokens,
                                        std::int32_t next) const {
  const auto it = by_key_.find(key);
  if (it == by_key_.end()) return -1;
  for (const std::int32_t b : it->second) {
    const CachedBlock& c = cached_[static_cast<std::size_t>(b)];
    if (c.parent == parent && std::ranges::equal(c.tokens, tokens) && (next < 0 || c.next_token == next)) return b;
  }
  return -1;
}

bool KvBlockManager::collides(std::uint64_t key, std::uint64_t parent, std::span<const std::int32_t> tokens) const {
  const auto it = by_key_.find(key);
  if (it == by_key_.end()) return false;
  return std::ranges::any_of(it->second, [&](std::int32_t b) {
    const CachedBlock& c = cached_[static_cast<std::size_t>(b)];
    return c.parent != parent || !std::ranges::equal(c.tokens, tokens);
  });
}

std::vector<std::int32_t> KvBlockManager::matchPrefix(std::span<const std::int32_t> tokens,
                                                      std::int64_t max_blocks) const {
  std::vector<std::int32_t> out;
  if (prefix_capacity_ == 0 || by_key_.empty()) return out;
  const std::int64_t full = std::min(static_cast<std::int64_t>(tokens.size()) / block_size_, max_blocks);
  std::uint64_t parent = model_hash_;
  for (std::int64_t i = 0; i < full; ++i) {
    const auto block = tokens.subspan(static_cast<std::size_t>(i * block_size_), static_cast<std::size_t>(block_size_));
    const std::uint64_t key = prefixBlockKey(parent, block);
    const auto after = static_cast<std::size_t>((i + 1) * block_size_);
    const std::int32_t hit = findCached(key, parent, block, after < tokens.size() ? tokens[after] : -1);
    if (hit < 0) break;
    out.push_back(hit);
    parent = key;
  }
  return out;
}

std::int64_t KvBlockManager::cachePrefix(std::uint64_t request_id, std::span<const std::int32_t> tokens,
                                         std::int64_t blocks) {
  const auto it = requests_.find(request_id);
  if (prefix_capacity_ == 0 || it == requests_.end() || it->second.quarantined) return 0;
  const Entry& e = it->second;
  PD_CHECK(blocks >= 0 && blocks <= static_cast<std::int64_t>(e.blocks.size()) &&
           static_cast<std::int64_t>(tokens.size()) > blocks * block_size_);
  std::int64_t added = 0;
  std::uint64_t parent = model_hash_;
  for (std::int64_t i = 0; i < blocks; ++i) {
    const auto span = tokens.subspan(static_cast<std::size_t>(i * block_size_), static_cast<std::size_t>(block_size_));
    const std::uint64_t key = prefixBlockKey(parent, span);
    const std::int32_t next = tokens[static_cast<std::size_t>((i + 1) * block_size_)];
    const std::int32_t b = e.blocks[static_cast<std::size_t>(i)];
    // A colliding key (other tokens or parent under it) ends the offer: the chain is not ours.
    if (collides(key, parent, span)) break;
    // Cached already with this next token (this very block, or a twin): the chain goes on.
    if (findCached(key, parent, span, next) >= 0) {
      parent = key;
      continue;
    }
    if (in_cache_[static_cast<std::size_t>(b)]) break;  // cached as another variant: not this one's
    if (cachedBlocks() >= prefix_capacity_) {
      if (idle_.empty()) break;
      evictOne();
    }
    const auto bi = static_cast<std::size_t>(b);
    addRef(b, false);  // the cache's reference; the request still holds it, so it is not idle
    cached_[bi] = CachedBlock{key, parent, std::vector<std::int32_t>(span.begin(), span.end()), next, b};
    by_key_[key].push_back(b);
    in_cache_[bi] = true;
    ++cached_blocks_;
    ++added;
    parent = key;
  }
  return added;
}

std::int64_t KvBlockManager::clearPrefixCache() {
  std::int64_t n = 0;
  while (!idle_.empty()) {
    evictOne();
    ++n;
  }
  return n;
}

bool KvBlockManager::isFreeButPrefixCache() const {
  if (!requests_.empty() || quarantined_blocks_ != 0 || shared_blocks_ != 0) return false;
  if (static_cast<std::int64_t>(free_.size() + idle_.size()) != num_blocks_ ||
      static_cast<std::int64_t>(idle_.size()) != cached_blocks_) {
    return false;
  }
  if (std::any_of(qrefs_.begin(), qrefs_.end(), [](std::int32_t r) { return r != 0; })) return false;
  for (std::size_t b = 0; b < refs_.size(); ++b) {
    if (refs_[b] != (in_cache_[b] ? 1 : 0)) return false;
    if (in_cache_[b]) {
      const auto it = by_key_.find(cached_[b].key);
      if (it == by_key_.end() || cached_[b].block != static_cast<std::int32_t>(b) ||
          std::ranges::count(it->second, static_cast<std::int32_t>(b)) != 1) {
        return false;
      }
    }
  }
  std::vector<bool> seen(static_cast<std::size_t>(num_blocks_), false);
  for (const std::int32_t b : free_) {
    if (b < 0 || b >= num_blocks_ || seen[static_cast<std::size_t>(b)] || in_cache_[static_cast<std::size_t>(b)]) {
      return false;
    }
    seen[static_cast<std::size_t>(b)] = true;
  }
  return true;
}

bool KvBlockManager::isFullyFree() const {
  if (!requests_.empty() || quarantined_blocks_ != 0 || shared_blocks_ != 0 || cached_blocks_ != 0) return false;
  if (static_cast<std::int64_t>(free_.size()) != num_blocks_) return false;
  if (std::any_of(refs_.begin(), refs_.end(), [](std::int32_t r) { return r != 0; })) return false;
  if (std::any_of(qrefs_.begin(), qrefs_.end(), [](std::int32_t r) { return r != 0; })) return false;
  std::vector<bool> seen(static_cast<std::size_t>(num_blocks_), false);
  for (const std::int32_t b : free_) {
    if (b < 0 || b >= num_blocks_ || seen[static_cast<std::size_t>(b)]) return false;
    seen[static_cast<std::size_t>(b)] = true;
  }
  return true;
}

}  // namespace pd::decode
