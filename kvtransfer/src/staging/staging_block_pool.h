#pragma once
/// The receiving side's staging blocks (docs/kv-transfer.md, "Staging path"): ids into a small
/// host pool registered with the network transport, handed out per granted request and mapped to
/// the KV pool's real blocks. Blocks of a receive that failed may still be written by a late
/// sender: they are quarantined until a deadline and only then reused.
///
/// Thread rules: not thread-safe; StagingTransport calls it under its own mutex.

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <vector>

namespace pd::kvtransfer::staging {

class StagingBlockPool {
 public:
  using Clock = std::chrono::steady_clock;

  /// Blocks 0 .. num_blocks-1, all free.
  explicit StagingBlockPool(std::uint32_t num_blocks);

  /// `count` free blocks, now taken (lowest ids first); nullopt when fewer are free. Quarantines
  /// that ended at or before `now` are reclaimed first.
  [[nodiscard]] std::optional<std::vector<std::uint32_t>> allocate(std::uint32_t count, Clock::time_point now);
  /// Frees taken blocks at once (nothing can still write them).
  void release(const std::vector<std::uint32_t>& blocks);
  /// Keeps taken blocks out of use until `until` (a late write may still land in them).
  void quarantine(const std::vector<std::uint32_t>& blocks, Clock::time_point until);

  [[nodiscard]] std::uint32_t total() const { return total_; }
  [[nodiscard]] std::uint32_t freeBlocks() const { return static_cast<std::uint32_t>(free_.size()); }
  [[nodiscard]] std::uint32_t quarantinedBlocks() const { return quarantined_count_; }

 private:
  void reclaim(Clock::time_point now);
  void markFree(std::uint32_t block);

  std::uint32_t total_;
  std::vector<std::uint32_t> free_;  // descending, so the lowest id is at the back
  std::vector<bool> taken_;
  std::multimap<Clock::time_point, std::vector<std::uint32_t>> quarantine_;  // by end
  std::uint32_t quarantined_count_ = 0;
};

}  // namespace pd::kvtransfer::staging
