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
}

std::int64_t KvBlockManager::blocksFor(std::int64_t tokens) const {
  return std::max<std::int64_t>(1, (tokens + block_size_ - 1) / block_size_);
}

std::int64_t KvBlockManager::availableBlocks() const {
  return std::max<std::int64_t>(0, freeBlocks() - headroom_blocks_);
}

Status KvBlockManager::admit(std::uint64_t request_id, std::int64_t prompt_tokens) {
  if (prompt_tokens <= 0) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("request {}: prompt_tokens {} must be positive", request_id, prompt_tokens));
  }
  if (requests_.contains(request_id)) {
    return makeError(ErrorCode::InvalidArgument, fmt::format("request {} is already admitted", request_id));
  }
  const std::int64_t need = blocksFor(prompt_tokens);
  if (need > num_blocks_) {
    return makeError(ErrorCode::ResourceExhausted,
                     fmt::format("request {} needs {} KV blocks for its {}-token prompt but the pool has only {}",
                                 request_id, need, prompt_tokens, num_blocks_));
  }
  if (need > availableBlocks()) {
    return makeError(ErrorCode::Overloaded,
                     fmt::format("request {} needs {} KV blocks; {} of {} are free ({} kept as headroom)", request_id,
                                 need, freeBlocks(), num_blocks_, headroom_blocks_));
  }
  Entry entry;
  entry.blocks.reserve(static_cast<std::size_t>(need));
  for (std::int64_t i = 0; i < need; ++i) {
    entry.blocks.push_back(free_.back());
    free_.pop_back();
  }
  requests_.emplace(request_id, std::move(entry));
  return okStatus();
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
  for (std::int64_t i = 0; i < missing; ++i) {
    e.blocks.push_back(free_.back());
    free_.pop_back();
  }
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
  if (e.quarantined) quarantined_blocks_ -= static_cast<std::int64_t>(e.blocks.size());
  // Returned in reverse so the next admission gets them back in the same order.
  for (auto b = e.blocks.rbegin(); b != e.blocks.rend(); ++b) free_.push_back(*b);
  requests_.erase(it);
  PD_CHECK(quarantined_blocks_ >= 0);
  return true;
}

std::int64_t KvBlockManager::quarantine(std::uint64_t request_id) {
  const auto it = requests_.find(request_id);
  if (it == requests_.end() || it->second.quarantined) return 0;
  Entry& e = it->second;
  const auto held = static_cast<std::int64_t>(e.blocks.size());
  e.quarantined = true;
  quarantined_blocks_ += held;
  return held;
}

bool KvBlockManager::isQuarantined(std::uint64_t request_id) const {
  const auto it = requests_.find(request_id);
  return it != requests_.end() && it->second.quarantined;
}

bool KvBlockManager::isFullyFree() const {
  if (!requests_.empty() || quarantined_blocks_ != 0) return false;
  if (static_cast<std::int64_t>(free_.size()) != num_blocks_) return false;
  std::vector<bool> seen(static_cast<std::size_t>(num_blocks_), false);
  for (const std::int32_t b : free_) {
    if (b < 0 || b >= num_blocks_ || seen[static_cast<std::size_t>(b)]) return false;
    seen[static_cast<std::size_t>(b)] = true;
  }
  return true;
}

}  // namespace pd::decode
