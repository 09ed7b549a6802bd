#include "pd/decode/kv_block_manager.h"

#include <fmt/format.h>

#include <algorithm>

namespace pd::decode {

KvBlockManager::KvBlockManager(std::int64_t num_blocks, std::int64_t block_size, std::int64_t headroom_blocks)
    : num_blocks_(num_blocks), block_size_(block_size), headroom_blocks_(headroom_blocks) {
  PD_CHECK(num_blocks > 0 && block_size > 0);
  PD_CHECK(num_blocks <= INT32_MAX);
  PD_CHECK(headroom_blocks >= 0 && headroom_blocks < num_blocks);
  free_.reserve(static_cast<std::size_t>(num_blocks));
  // Pushed in reverse so that a fresh pool hands out block 0 first.
  for (std::int64_t b = num_blocks - 1; b >= 0; --b) free_.push_back(static_cast<std::int32_t>(b));
  refs_.assign(static_cast<std::size_t>(num_blocks), 0);
  qrefs_.assign(static_cast<std::size_t>(num_blocks), 0);
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
  change(refs_[i], qrefs_[i]);
  PD_CHECK(refs_[i] >= 0 && qrefs_[i] >= 0 && qrefs_[i] <= refs_[i]);
  quarantined_blocks_ += static_cast<std::int64_t>(quarantined()) - static_cast<std::int64_t>(was_quarantined);
  shared_blocks_ += static_cast<std::int64_t>(refs_[i] > 1) - static_cast<std::int64_t>(was_shared);
}

std::int32_t KvBlockManager::take() {
  PD_CHECK(!free_.empty());
  const std::int32_t b = free_.back();
  free_.pop_back();
  PD_CHECK(refs_[static_cast<std::size_t>(b)] == 0);
  recount(b, [](std::int32_t& refs, std::int32_t&) { refs = 1; });
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

Status KvBlockManager::admit(std::uint64_t request_id, std::int64_t prompt_tokens, std::int64_t spare_blocks) {
  if (prompt_tokens <= 0 || spare_blocks < 0) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("request {}: prompt_tokens {} must be positive and spare blocks {} not negative",
                                 request_id, prompt_tokens, spare_blocks));
  }
  if (requests_.contains(request_id)) {
    return makeError(ErrorCode::InvalidArgument, fmt::format("request {} is already admitted", request_id));
  }
  const std::int64_t prompt_blocks = blocksFor(prompt_tokens);
  const std::int64_t need = prompt_blocks + spare_blocks;
  if (need > num_blocks_) {
    return makeError(ErrorCode::ResourceExhausted,
                     fmt::format("request {} needs {} KV blocks for its {}-token prompt ({} of them for its choices) "
                                 "but the pool has only {}",
                                 request_id, need, prompt_tokens, spare_blocks, num_blocks_));
  }
  if (need > availableBlocks()) {
    return makeError(ErrorCode::Overloaded,
                     fmt::format("request {} needs {} KV blocks; {} of {} are free ({} kept as headroom)", request_id,
                                 need, freeBlocks(), num_blocks_, headroom_blocks_));
  }
  Entry entry;
  entry.blocks.reserve(static_cast<std::size_t>(prompt_blocks));
  for (std::int64_t i = 0; i < prompt_blocks; ++i) entry.blocks.push_back(take());
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

bool KvBlockManager::isFullyFree() const {
  if (!requests_.empty() || quarantined_blocks_ != 0 || shared_blocks_ != 0) return false;
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
