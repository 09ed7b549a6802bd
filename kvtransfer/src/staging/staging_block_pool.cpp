#include "staging/staging_block_pool.h"

#include <algorithm>
#include <functional>

#include "pd/common/check.h"

namespace pd::kvtransfer::staging {

StagingBlockPool::StagingBlockPool(std::uint32_t num_blocks) : total_(num_blocks), taken_(num_blocks, false) {
  free_.reserve(num_blocks);
  for (std::uint32_t b = num_blocks; b > 0; --b) free_.push_back(b - 1);
}

std::optional<std::vector<std::uint32_t>> StagingBlockPool::allocate(std::uint32_t count, Clock::time_point now) {
  reclaim(now);
  if (count > free_.size()) return std::nullopt;
  std::vector<std::uint32_t> blocks;
  blocks.reserve(count);
  for (std::uint32_t i = 0; i < count; ++i) {
    const std::uint32_t b = free_.back();
    free_.pop_back();
    taken_[b] = true;
    blocks.push_back(b);
  }
  return blocks;
}

void StagingBlockPool::release(const std::vector<std::uint32_t>& blocks) {
  for (const std::uint32_t b : blocks) markFree(b);
}

void StagingBlockPool::quarantine(const std::vector<std::uint32_t>& blocks, Clock::time_point until) {
  for (const std::uint32_t b : blocks) PD_CHECK(b < total_ && taken_[b]);
  if (blocks.empty()) return;
  quarantined_count_ += static_cast<std::uint32_t>(blocks.size());
  quarantine_.emplace(until, blocks);
}

void StagingBlockPool::reclaim(Clock::time_point now) {
  while (!quarantine_.empty() && quarantine_.begin()->first <= now) {
    const std::vector<std::uint32_t> blocks = std::move(quarantine_.begin()->second);
    quarantine_.erase(quarantine_.begin());
    quarantined_count_ -= static_cast<std::uint32_t>(blocks.size());
    for (const std::uint32_t b : blocks) markFree(b);
  }
}

void StagingBlockPool::markFree(std::uint32_t block) {
  PD_CHECK(block < total_ && taken_[block]);
  taken_[block] = false;
  // Keep the free list descending so allocation hands out the lowest ids first.
  free_.insert(std::upper_bound(free_.begin(), free_.end(), block, std::greater<>()), block);
}

}  // namespace pd::kvtransfer::staging
