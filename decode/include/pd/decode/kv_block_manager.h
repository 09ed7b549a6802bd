#pragma once
/// Accounting of the decode worker's paged latent-KV pool: which blocks each request owns.
///
/// Reservation policy (DESIGN §3 step 2): a request is admitted only if its worst case fits —
/// the caller passes it as reserved_tokens (the decode engine: prompt + max_tokens - 1, since
/// every token but the last is written to the cache and MTP drafts are clipped to the tokens the
/// request may still produce, so they never need more). Blocks for the prompt are allocated at admission (the prefill
/// worker writes into them); the rest of the reservation is held back from other admissions and turned into blocks by
/// grow() as tokens are generated. So a running request never runs out of blocks mid-stream and nothing has to be
/// preempted; the price is that capacity a request might not use (an early EOS) is unavailable to others until it
/// finishes.
///
/// Quarantine (late-write guard of the rma data path, decode_engine.h): quarantine() takes a
/// request's blocks out of use without returning them to the free list — nothing new is
/// allocated into them, its unallocated reservation is given back at once, and release() later
/// frees them. Quarantined blocks count neither as free nor as available.
///
/// Errors: admit() answers ResourceExhausted when the request can never fit (its reservation is
/// larger than the whole pool: not retryable), Overloaded when it would fit an empty pool but
/// not now (retryable), InvalidArgument for a duplicate id or non-positive sizes.
///
/// Thread rules: engine thread only (the decode engine loop owns it); no internal locking.

#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

#include "pd/common/result.h"

namespace pd::decode {

class KvBlockManager {
 public:
  /// A pool of `num_blocks` blocks of `block_size` tokens (both PD_CHECKed positive).
  KvBlockManager(std::int64_t num_blocks, std::int64_t block_size);

  /// Reserves ceil(reserved_tokens / block_size) blocks for `request_id` and allocates those
  /// that hold `prompt_tokens` (at least one block). reserved_tokens >= prompt_tokens.
  [[nodiscard]] Status admit(std::uint64_t request_id, std::int64_t prompt_tokens, std::int64_t reserved_tokens);

  /// Makes the request's block table cover positions [0, tokens). InvalidArgument when that is
  /// beyond its reservation, NotFound for an unknown id. Never takes another request's blocks.
  [[nodiscard]] Status grow(std::uint64_t request_id, std::int64_t tokens);

  /// The request's blocks in position order (position p is in blocks[p / block_size]). Empty for
  /// an unknown id. Valid until the next admit/grow/release.
  [[nodiscard]] std::span<const std::int32_t> blockTable(std::uint64_t request_id) const;

  /// Returns every block and the reservation of `request_id` to the pool (quarantined or not).
  /// False if unknown.
  bool release(std::uint64_t request_id);

  /// Holds the request's allocated blocks back from the free list until release(), and gives
  /// its unallocated reservation back now. grow() fails for it from then on. Returns the number
  /// of blocks held; 0 for an unknown or already quarantined id.
  std::int64_t quarantine(std::uint64_t request_id);
  [[nodiscard]] bool isQuarantined(std::uint64_t request_id) const;

  [[nodiscard]] bool contains(std::uint64_t request_id) const { return requests_.contains(request_id); }
  [[nodiscard]] std::int64_t numBlocks() const { return num_blocks_; }
  [[nodiscard]] std::int64_t blockSize() const { return block_size_; }
  /// Blocks not allocated to any request (quarantined blocks are not free).
  [[nodiscard]] std::int64_t freeBlocks() const { return static_cast<std::int64_t>(free_.size()); }
  /// Blocks held by quarantined requests.
  [[nodiscard]] std::int64_t quarantinedBlocks() const { return quarantined_blocks_; }
  /// Blocks a new admission may take: free blocks minus the unallocated part of reservations.
  [[nodiscard]] std::int64_t availableBlocks() const { return freeBlocks() - pending_reservation_; }
  /// Requests holding blocks, quarantined ones included.
  [[nodiscard]] std::size_t numRequests() const { return requests_.size(); }
  /// Blocks needed to hold `tokens` tokens (at least one).
  [[nodiscard]] std::int64_t blocksFor(std::int64_t tokens) const;

  /// The invariant checked after every test: no request, nothing quarantined, every block free,
  /// nothing reserved, and the free list holds each block id exactly once.
  [[nodiscard]] bool isFullyFree() const;

 private:
  struct Entry {
    std::vector<std::int32_t> blocks;
    std::int64_t reserved_blocks = 0;
    bool quarantined = false;
  };

  std::int64_t num_blocks_;
  std::int64_t block_size_;
  std::vector<std::int32_t> free_;        // a stack: the most recently freed block is reused first
  std::int64_t pending_reservation_ = 0;  // sum over requests of reserved - allocated blocks
  std::int64_t quarantined_blocks_ = 0;   // blocks of quarantined requests
  std::unordered_map<std::uint64_t, Entry> requests_;
};

}  // namespace pd::decode
