#pragma once
/// Which positions of a host paged latent cache an engine's own copy of it (the CUDA engine's
/// device cache) must re-read before a forward call, so that only what changed crosses over
/// instead of every sequence's whole prefix on every call.
///
/// Per block of the copy it keeps the epoch it last read the block at (the cache's
/// LatentCacheView::block_epochs) and how many leading positions it holds. Before a call that
/// reads positions [0, start_pos) of each sequence and writes [start_pos, start_pos + tokens):
/// a block whose epoch moved is held from position 0 again; the needed positions not held are
/// returned to be copied; afterwards the call's writes are held too (the engine writes them into
/// its copy and mirrors them into the host cache, so both agree).
///
/// Views without epochs (a scratch cache, a TP follower's pool): every needed position is
/// returned, and every block the call touches is forgotten afterwards, since the copy's slots
/// now hold that other cache's data. A change of geometry, or a failed call (forget()),
/// forgets everything. Epochs are unique in the process (KvPool draws them from one counter), so
/// two caches never share one.
///
/// Thread rules: one thread at a time (the engine's).

#include <cstdint>
#include <span>
#include <vector>

#include "pd/engine/engine.h"
#include "pd/engine/latent_cache.h"

namespace pd::model {

class CacheResidency {
 public:
  /// Positions [first, first + count) of one block.
  struct Range {
    std::int64_t block = 0;
    std::int64_t first = 0;
    std::int64_t count = 0;
    bool operator==(const Range&) const = default;
  };

  /// The ranges to copy before a call over `batch` on `cache` (block tables as validated by the
  /// engine: every block id in [0, num_blocks), each table long enough), in batch order; records
  /// them, and the call's writes, as held.
  [[nodiscard]] std::vector<Range> prepare(std::span<const SequenceChunk> batch, const LatentCacheView& cache);
  /// Forgets every block (a failed call, a reallocated copy).
  void forget();
  /// Blocks with at least one position held.
  [[nodiscard]] std::int64_t heldBlocks() const;
  /// Positions returned by prepare() since the last call (what was copied).
  [[nodiscard]] std::int64_t takeCopiedPositions();

 private:
  struct Block {
    std::uint64_t epoch = 0;  // 0: never read (KvPool's epochs start at 1)
    std::int64_t held = 0;    // positions [0, held) of the block are in the copy
  };
  std::vector<Block> blocks_;
  std::int64_t block_size_ = 0;
  DType dtype_ = DType::F32;
  std::int64_t copied_ = 0;
};

/// A fresh epoch, unique in the process (KvPool::touch, KvPool::enableEpochs).
[[nodiscard]] std::uint64_t nextCacheEpoch();

}  // namespace pd::model
