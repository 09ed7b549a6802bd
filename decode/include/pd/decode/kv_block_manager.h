#pragma once
/// Accounting of the decode worker's paged latent-KV pool: which blocks each request owns.
///
/// On-demand policy (DESIGN §3, docs/kv-memory.md): a request is admitted on its prompt's blocks
/// alone — the prefill worker writes into them — provided `headroom_blocks` stay free after it
/// (the watermark: room for the running requests to grow a while before anything must be
/// preempted). Later blocks are allocated one at a time by grow() as tokens (and MTP drafts) are
/// written. Nothing is reserved: grow() answers Overloaded when the free list runs dry, and the
/// decode engine then preempts a request (decode_engine.h, "Preemption") and tries again.
///
/// Quarantine (late-write guard of the rma data path, decode_engine.h): quarantine() takes a
/// request's blocks out of use without returning them to the free list — nothing new is
/// allocated into them, and release() later frees them. Quarantined blocks count neither as free
/// nor as available.
///
/// Shared blocks (n > 1 choices, docs/kv-memory.md "Choices share the prompt"): a request may be
/// admitted with spare blocks, and fork() then gives a child request a block table that shares
/// the parent's blocks by reference count — all but the last, which the child gets a private copy
/// of (one of the spares: copy-on-write, done by the caller before anything writes). Every block
/// has a reference count (the requests whose table or spares hold it); release() drops a request's
/// references, and a block returns to the free list only when its last holder lets go. grow()
/// only appends fresh blocks, so a shared block is never handed out for writing.
///
/// Errors: admit() answers ResourceExhausted when the prompt alone can never fit (more blocks
/// than the whole pool: not retryable), Overloaded when it would fit an empty pool but not now
/// (retryable), InvalidArgument for a duplicate id or a non-positive size.
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
  /// A pool of `num_blocks` blocks of `block_size` tokens (both PD_CHECKed positive); admissions
  /// leave `headroom_blocks` (>= 0, below num_blocks) free.
  KvBlockManager(std::int64_t num_blocks, std::int64_t block_size, std::int64_t headroom_blocks = 0);

  /// Allocates the blocks that hold `prompt_tokens` (at least one block) for `request_id`, plus
  /// `spare_blocks` (>= 0) held back for fork(); the headroom must stay free after both.
  [[nodiscard]] Status admit(std::uint64_t request_id, std::int64_t prompt_tokens, std::int64_t spare_blocks = 0);

  /// Which block to copy into which, after fork(): every layer of `src` into `dst`.
  struct BlockCopy {
    std::int32_t src = 0;
    std::int32_t dst = 0;
  };
  /// Gives `child_id` the parent's block table with its last block replaced by one of the
  /// parent's spares (the copy the caller must make: `src` is the parent's last block); the other
  /// blocks are shared (their reference counts go up). Takes nothing from the free list.
  /// NotFound for an unknown parent; InvalidArgument for a quarantined parent, an existing child
  /// id, or a parent without a spare left.
  [[nodiscard]] Result<BlockCopy> fork(std::uint64_t parent_id, std::uint64_t child_id);
  /// Returns the request's unused spares to the free list; the number returned (0 if unknown).
  std::int64_t releaseSpares(std::uint64_t request_id);

  /// Makes the request's block table cover positions [0, tokens), taking free blocks (the
  /// headroom too: it exists for this). All or nothing: Overloaded (nothing taken) when the free
  /// list holds fewer than the blocks missing; NotFound for an unknown id; InvalidArgument for a
  /// quarantined one. Never takes another request's blocks.
  [[nodiscard]] Status grow(std::uint64_t request_id, std::int64_t tokens);

  /// The request's blocks in position order (position p is in blocks[p / block_size]). Empty for
  /// an unknown id. Valid until the next admit/grow/release.
  [[nodiscard]] std::span<const std::int32_t> blockTable(std::uint64_t request_id) const;

  /// Drops every reference of `request_id` (its table and spares, quarantined or not); blocks
  /// nobody else holds return to the pool. False if unknown.
  bool release(std::uint64_t request_id);

  /// Holds the request's blocks back from the free list until release(); grow() and fork() fail
  /// for it from then on. Returns the number of blocks held (shared ones included); 0 for an
  /// unknown or already quarantined id.
  std::int64_t quarantine(std::uint64_t request_id);
  [[nodiscard]] bool isQuarantined(std::uint64_t request_id) const;

  [[nodiscard]] bool contains(std::uint64_t request_id) const { return requests_.contains(request_id); }
  [[nodiscard]] std::int64_t numBlocks() const { return num_blocks_; }
  [[nodiscard]] std::int64_t blockSize() const { return block_size_; }
  [[nodiscard]] std::int64_t headroomBlocks() const { return headroom_blocks_; }
  /// Blocks not allocated to any request (quarantined blocks are not free).
  [[nodiscard]] std::int64_t freeBlocks() const { return static_cast<std::int64_t>(free_.size()); }
  /// Blocks allocated to requests, quarantined ones included.
  [[nodiscard]] std::int64_t usedBlocks() const { return num_blocks_ - freeBlocks(); }
  /// Blocks whose every holder is quarantined (what is held back only for late writes).
  [[nodiscard]] std::int64_t quarantinedBlocks() const { return quarantined_blocks_; }
  /// Blocks held by more than one request.
  [[nodiscard]] std::int64_t sharedBlocks() const { return shared_blocks_; }
  /// How many requests hold `block` (0: free). PD_CHECKs the id.
  [[nodiscard]] std::int32_t refCount(std::int32_t block) const;
  /// Blocks a new admission may take: free blocks minus the headroom (never negative).
  [[nodiscard]] std::int64_t availableBlocks() const;
  /// Requests holding blocks, quarantined ones included.
  [[nodiscard]] std::size_t numRequests() const { return requests_.size(); }
  /// Blocks needed to hold `tokens` tokens (at least one).
  [[nodiscard]] std::int64_t blocksFor(std::int64_t tokens) const;

  /// The invariant checked after every test: no request, nothing quarantined or shared, every
  /// reference count zero, and the free list holds each block id exactly once.
  [[nodiscard]] bool isFullyFree() const;

 private:
  struct Entry {
    std::vector<std::int32_t> blocks;
    std::vector<std::int32_t> spares;  // admitted for fork(), not in the table
    bool quarantined = false;
  };

  // Takes a fresh block off the free list (reference count 1).
  std::int32_t take();
  // One more holder of `b` (quarantined or not).
  void addRef(std::int32_t b, bool quarantined);
  // One holder less; the block is freed when it was the last.
  void dropRef(std::int32_t b, bool quarantined);
  // Runs `change` on `b`'s counts and keeps the shared and quarantined totals in step.
  template <typename Change>
  void recount(std::int32_t b, Change change);

  std::int64_t num_blocks_;
  std::int64_t block_size_;
  std::int64_t headroom_blocks_;
  std::vector<std::int32_t> free_;       // a stack: the most recently freed block is reused first
  std::vector<std::int32_t> refs_;       // per block: the requests holding it
  std::vector<std::int32_t> qrefs_;      // per block: the quarantined requests holding it
  std::int64_t quarantined_blocks_ = 0;  // blocks with refs_ > 0 == qrefs_
  std::int64_t shared_blocks_ = 0;       // blocks with refs_ > 1
  std::unordered_map<std::uint64_t, Entry> requests_;
};

}  // namespace pd::decode
