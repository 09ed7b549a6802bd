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
/// Prefix cache (decode-side prefix reuse, docs/kv-memory.md "Prefix reuse on the decode side"):
/// with `prefix_cache_blocks` > 0 the manager keeps up to that many full blocks of finished
/// requests' prompts, keyed by the prefix hash chain (prefix_hash.h, chained from the model hash).
/// The cache is one more holder of each block it keeps (one reference), so a cached block that a
/// request also holds has a count of 2 and is never freed under it. A cached block only the cache
/// holds is *idle*: idle blocks count as free (freeBlocks(), availableBlocks()), and take() evicts
/// them, least recently used first, when the free list is empty — before any preemption, and never
/// one a request holds. A key is only an index: a match also compares the block's tokens, its
/// parent key and the token after it (whose pairing the block's MTP-layer row at its last position
/// depends on), so a collision is a miss, never wrong KV. One key may hold several blocks, one per
/// next token (conversations sharing a system prompt that ends inside a block). Cached blocks are read-only: admit()
/// puts them at the head of a request's table and grow()/fork() never hand them out for writing
/// (the caller only writes positions past them).
///
/// Errors: admit() answers ResourceExhausted when the prompt alone can never fit (more blocks
/// than the whole pool: not retryable), Overloaded when it would fit an empty pool but not now
/// (retryable), InvalidArgument for a duplicate id or a non-positive size.
///
/// Thread rules: engine thread only (the decode engine loop owns it); no internal locking.

#include <cstdint>
#include <functional>
#include <list>
#include <span>
#include <unordered_map>
#include <vector>

#include "pd/common/result.h"

namespace pd::decode {

class KvBlockManager {
 public:
  /// A pool of `num_blocks` blocks of `block_size` tokens (both PD_CHECKed positive); admissions
  /// leave `headroom_blocks` (>= 0, below num_blocks) free.
  /// `prefix_cache_blocks` (>= 0; 0: no prefix cache) bounds the blocks the prefix cache keeps;
  /// `model_hash` starts its hash chain.
  KvBlockManager(std::int64_t num_blocks, std::int64_t block_size, std::int64_t headroom_blocks = 0,
                 std::int64_t prefix_cache_blocks = 0, std::uint64_t model_hash = 0);

  /// Allocates the blocks that hold `prompt_tokens` (at least one block) for `request_id`, plus
  /// `spare_blocks` (>= 0) held back for fork(); the headroom must stay free after both.
  /// `shared_prefix` (from matchPrefix(), fewer blocks than the prompt's) become the table's first
  /// blocks, shared with the prefix cache (a reference each); only the rest are fresh. An idle
  /// shared block stops counting as free, so it counts against the headroom like a fresh one.
  /// InvalidArgument when a shared block is not cached or there are as many as the prompt's blocks.
  [[nodiscard]] Status admit(std::uint64_t request_id, std::int64_t prompt_tokens, std::int64_t spare_blocks = 0,
                             std::span<const std::int32_t> shared_prefix = {});

  /// The prefix cache's longest run of blocks holding `tokens`' leading full blocks, at most
  /// `max_blocks`, as block ids in position order. A block i matches when its key, tokens and
  /// parent match and, when `tokens` goes on past it, the cached token after it equals
  /// tokens[(i + 1) * block_size]. Empty without a prefix cache. Changes nothing.
  [[nodiscard]] std::vector<std::int32_t> matchPrefix(std::span<const std::int32_t> tokens,
                                                      std::int64_t max_blocks) const;
  /// Offers the request's first `blocks` table blocks to the prefix cache; `tokens` holds at least
  /// blocks * block_size + 1 tokens (the prompt: the block's tokens and the one after it). Blocks
  /// already cached under their key are skipped (the chain goes on through the cached one); the
  /// offer stops at a colliding key, or when the cache is full and has no idle block to displace.
  /// The caller guarantees the blocks' KV is complete and will not be written again. Returns the
  /// blocks newly cached. 0 without a prefix cache, for an unknown or quarantined request.
  std::int64_t cachePrefix(std::uint64_t request_id, std::span<const std::int32_t> tokens, std::int64_t blocks);
  /// Evicts every idle cached block (tests, shutdown); returns how many.
  std::int64_t clearPrefixCache();

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
  /// Called with each block as it is handed to a new owner (a fresh block of admit, grow or
  /// fork; not a shared prefix-cache block): KvPool::touch, so that an engine's copy of the cache
  /// re-reads it. Set once, before the first admission.
  void setOnTake(std::function<void(std::int32_t)> on_take) { on_take_ = std::move(on_take); }
  [[nodiscard]] std::int64_t numBlocks() const { return num_blocks_; }
  [[nodiscard]] std::int64_t blockSize() const { return block_size_; }
  [[nodiscard]] std::int64_t headroomBlocks() const { return headroom_blocks_; }
  /// Blocks a request may take: those on the free list plus idle prefix-cache blocks (which
  /// take() evicts first). Quarantined blocks are not free.
  [[nodiscard]] std::int64_t freeBlocks() const { return static_cast<std::int64_t>(free_.size() + idle_.size()); }
  /// Blocks the prefix cache holds (idle or also held by requests), and the idle ones.
  [[nodiscard]] std::int64_t cachedBlocks() const { return cached_blocks_; }
  [[nodiscard]] std::int64_t idleCachedBlocks() const { return static_cast<std::int64_t>(idle_.size()); }
  /// Cached blocks given back to the free list since construction (pressure or capacity).
  [[nodiscard]] std::int64_t prefixEvictions() const { return prefix_evictions_; }
  [[nodiscard]] std::int64_t prefixCacheCapacity() const { return prefix_capacity_; }
  /// Blocks allocated to requests, quarantined ones included (not idle cached ones).
  [[nodiscard]] std::int64_t usedBlocks() const { return num_blocks_ - freeBlocks(); }
  /// Blocks whose every holder is quarantined (what is held back only for late writes).
  [[nodiscard]] std::int64_t quarantinedBlocks() const { return quarantined_blocks_; }
  /// Blocks held by more than one holder (requests and the prefix cache).
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
  /// isFullyFree() but for the prefix cache: no request, nothing quarantined, every block either
  /// free (count 0, on the free list once) or idle in the cache (count 1), and the cache's
  /// bookkeeping consistent with the counts.
  [[nodiscard]] bool isFreeButPrefixCache() const;

 private:
  struct Entry {
    std::vector<std::int32_t> blocks;
    std::vector<std::int32_t> spares;  // admitted for fork(), not in the table
    bool quarantined = false;
  };

  struct CachedBlock {
    std::uint64_t key = 0;
    std::uint64_t parent = 0;
    std::vector<std::int32_t> tokens;
    std::int32_t next_token = -1;
    std::int32_t block = 0;
  };

  // Takes a fresh block off the free list (reference count 1), evicting an idle cached block
  // first when the list is empty.
  std::int32_t take();
  // Removes the least recently used idle cached block from the cache and frees it.
  void evictOne();
  // The cached block under `key` whose tokens and parent match and whose next token is `next`
  // (-1: any); -1 when there is none.
  [[nodiscard]] std::int32_t findCached(std::uint64_t key, std::uint64_t parent, std::span<const std::int32_t> tokens,
                                        std::int32_t next) const;
  // Whether a block is cached under `key` with other tokens or another parent (a hash collision).
  [[nodiscard]] bool collides(std::uint64_t key, std::uint64_t parent, std::span<const std::int32_t> tokens) const;
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
  // The prefix cache: the blocks cached under each key (one per next token: the blocks' main
  // layers are the same, their last MTP rows differ), each block's entry (valid when
  // in_cache_[b]), and the idle ones (reference count 1: only the cache) least recently used first.
  std::int64_t prefix_capacity_;
  std::uint64_t model_hash_;
  std::unordered_map<std::uint64_t, std::vector<std::int32_t>> by_key_;
  std::vector<CachedBlock> cached_;
  std::vector<bool> in_cache_;
  std::int64_t cached_blocks_ = 0;
  std::list<std::int32_t> idle_;
  std::function<void(std::int32_t)> on_take_;
  std::vector<std::list<std::int32_t>::iterator> idle_pos_;  // valid while the block is idle
  std::int64_t prefix_evictions_ = 0;
};

}  // namespace pd::decode
