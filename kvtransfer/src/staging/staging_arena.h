#pragma once
/// Byte ranges of the sending side's staging buffer (docs/kv-transfer.md, "Staging path"): each
/// admitted transfer holds one contiguous range, as long as its whole KV, until the transport
/// answers it. First fit over a free list that merges neighbours on release.
///
/// Thread rules: not thread-safe; StagingTransport calls it under its own mutex.

#include <cstdint>
#include <map>
#include <optional>

namespace pd::kvtransfer::staging {

class StagingArena {
 public:
  /// An arena of `capacity` bytes, all free.
  explicit StagingArena(std::uint64_t capacity);

  /// The offset of `bytes` free contiguous bytes (the lowest that fits), now taken; nullopt when
  /// no free range is large enough. `bytes` 0 takes nothing and returns nullopt.
  [[nodiscard]] std::optional<std::uint64_t> allocate(std::uint64_t bytes);
  /// Gives back the range that allocate() returned at `offset`; PD_CHECKs that it was taken.
  void release(std::uint64_t offset);

  [[nodiscard]] std::uint64_t capacity() const { return capacity_; }
  [[nodiscard]] std::uint64_t used() const { return used_; }
  /// The longest free range.
  [[nodiscard]] std::uint64_t largestFree() const;

 private:
  std::uint64_t capacity_;
  std::uint64_t used_ = 0;
  std::map<std::uint64_t, std::uint64_t> free_;   // offset -> length, no two adjacent
  std::map<std::uint64_t, std::uint64_t> taken_;  // offset -> length
};

}  // namespace pd::kvtransfer::staging
