#include "pd/engine/cache_residency.h"

#include <algorithm>
#include <atomic>

namespace pd::model {

std::uint64_t nextCacheEpoch() {
  static std::atomic<std::uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

void CacheResidency::forget() {
  blocks_.assign(blocks_.size(), Block{});
}

std::int64_t CacheResidency::heldBlocks() const {
  return std::count_if(blocks_.begin(), blocks_.end(), [](const Block& b) { return b.held > 0; });
}

std::int64_t CacheResidency::takeCopiedPositions() {
  const std::int64_t n = copied_;
  copied_ = 0;
  return n;
}

std::vector<CacheResidency::Range> CacheResidency::prepare(std::span<const SequenceChunk> batch,
                                                           const LatentCacheView& cache) {
  const auto num_blocks = static_cast<std::size_t>(cache.num_blocks);
  if (blocks_.size() != num_blocks || block_size_ != cache.block_size || dtype_ != cache.dtype) {
    blocks_.assign(num_blocks, Block{});
    block_size_ = cache.block_size;
    dtype_ = cache.dtype;
  }
  const bool epochs = cache.block_epochs.size() == num_blocks && num_blocks > 0;
  const std::int64_t bs = cache.block_size;
  std::vector<Range> out;
  // A table shorter than its chunk, or a block id outside the cache, is bad input the engine
  // refuses after this: such a table is read only as far as it goes and such ids are skipped, so
  // nothing is read or written out of bounds on the way to that error.
  const auto blocks_of = [&](const SequenceChunk& s, std::int64_t end) {
    return std::min((end + bs - 1) / bs, static_cast<std::int64_t>(s.block_table.size()));
  };
  const auto valid = [&](std::int32_t id) { return id >= 0 && static_cast<std::size_t>(id) < num_blocks; };
  for (const SequenceChunk& s : batch) {
    const std::int64_t end = s.start_pos + static_cast<std::int64_t>(s.tokens.size());
    for (std::int64_t first = 0; first / bs < blocks_of(s, end); first += bs) {
      const std::int32_t id = s.block_table[static_cast<std::size_t>(first / bs)];
      if (!valid(id)) continue;
      const std::int64_t need = std::clamp<std::int64_t>(s.start_pos - first, 0, bs);  // positions read
      Block& b = blocks_[static_cast<std::size_t>(id)];
      if (!epochs) {
        if (need > 0) out.push_back({id, 0, need});
        continue;
      }
      const std::uint64_t epoch = cache.block_epochs[static_cast<std::size_t>(id)];
      if (b.epoch != epoch) b = Block{epoch, 0};
      if (b.held < need) {
        out.push_back({id, b.held, need - b.held});
        b.held = need;
      }
    }
  }
  // The call's writes: held from now on (a view without epochs: every touched block forgotten).
  for (const SequenceChunk& s : batch) {
    const std::int64_t end = s.start_pos + static_cast<std::int64_t>(s.tokens.size());
    for (std::int64_t first = (s.start_pos / bs) * bs; first / bs < blocks_of(s, end); first += bs) {
      const std::int32_t id = s.block_table[static_cast<std::size_t>(first / bs)];
      if (!epochs || !valid(id)) continue;
      Block& b = blocks_[static_cast<std::size_t>(id)];
      const std::int64_t written_end = std::min(end - first, bs);
      if (b.held >= std::max<std::int64_t>(s.start_pos - first, 0)) b.held = std::max(b.held, written_end);
    }
    if (!epochs) {
      for (std::int64_t first = 0; first / bs < blocks_of(s, end); first += bs) {
        const std::int32_t id = s.block_table[static_cast<std::size_t>(first / bs)];
        if (valid(id)) blocks_[static_cast<std::size_t>(id)] = Block{};
      }
    }
  }
  for (const Range& r : out) copied_ += r.count;
  return out;
}

}  // namespace pd::model
