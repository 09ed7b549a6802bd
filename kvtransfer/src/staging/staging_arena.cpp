#include "staging/staging_arena.h"

#include <algorithm>

#include "pd/common/check.h"

namespace pd::kvtransfer::staging {

StagingArena::StagingArena(std::uint64_t capacity) : capacity_(capacity) {
  if (capacity > 0) free_.emplace(0, capacity);
}

std::optional<std::uint64_t> StagingArena::allocate(std::uint64_t bytes) {
  if (bytes == 0) return std::nullopt;
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < bytes) continue;
    const std::uint64_t offset = it->first;
    const std::uint64_t rest = it->second - bytes;
    free_.erase(it);
    if (rest > 0) free_.emplace(offset + bytes, rest);
    taken_.emplace(offset, bytes);
    used_ += bytes;
    return offset;
  }
  return std::nullopt;
}

void StagingArena::release(std::uint64_t offset) {
  const auto taken = taken_.find(offset);
  PD_CHECK(taken != taken_.end());
  std::uint64_t start = offset;
  std::uint64_t length = taken->second;
  used_ -= length;
  taken_.erase(taken);
  auto next = free_.lower_bound(start);
  if (next != free_.end() && next->first == start + length) {
    length += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == start) {
      start = prev->first;
      length += prev->second;
      free_.erase(prev);
    }
  }
  free_.emplace(start, length);
}

std::uint64_t StagingArena::largestFree() const {
  std::uint64_t best = 0;
  for (const auto& [offset, length] : free_) best = std::max(best, length);
  return best;
}

}  // namespace pd::kvtransfer::staging
