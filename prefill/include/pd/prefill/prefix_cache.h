#pragma once
/// The prefill worker's prefix cache (issue 19, docs/kv-memory section of docs/engine.md): full
/// blocks of the local latent cache kept after their prompt is done, keyed by a hash chain over
/// their tokens, so that a later prompt with the same leading blocks reuses their KV instead of
/// recomputing it.
///
/// Keys: block i of a prompt has key h_i = H(h_{i-1}, tokens of block i) with h_{-1} = the model
/// hash, so a key names a whole prefix on one model. A hash is only an index: every match also
/// compares the block's tokens and its parent key, so a colliding (or adversarial) prompt is a
/// miss, never wrong KV.
///
/// Ownership: the cache holds block ids it took from insert() until evict() hands them back.
/// Each held block has a reference count (the running requests that acquire()d it); blocks with
/// no reference are idle and ordered least recently used first. Capacity bounds the blocks held
/// (idle or referenced); eviction takes idle blocks only, leaves of a chain before their parents
/// when they were used together.
///
/// Events: with a KvEventLog, every block that enters the cache is reported stored() and every
/// block that leaves it (evicted or displaced) removed(), so routers can follow what it holds.
///
/// Thread rules: not thread-safe; the prefill engine thread owns it.

#include <cstdint>
#include <list>
#include <span>
#include <unordered_map>
#include <vector>

#include "pd/prefill/kv_event_log.h"

namespace pd::prefill {

struct PrefixCacheStats {
  std::int64_t cached_blocks = 0;  ///< blocks held (idle or referenced)
  std::int64_t idle_blocks = 0;    ///< held blocks no running request references
  std::int64_t evictions = 0;      ///< blocks handed back by evict() or displaced by insert()
};

class PrefixCache {
 public:
  /// One cached block as acquire() returns it.
  struct Hit {
    std::uint64_t key = 0;
    std::int32_t block = 0;
    std::span<const float> payload;  ///< what insert() stored with it (valid while referenced)
  };

  /// `capacity_blocks` > 0 and `block_size` > 0 (checked by the caller's options). `events`
  /// (optional) must outlive the cache.
  PrefixCache(std::int64_t capacity_blocks, std::int64_t block_size, std::uint64_t model_hash,
              KvEventLog* events = nullptr);

  /// The hash chain of the first `max_blocks` full blocks of `tokens` (prefix_hash.h).
  [[nodiscard]] static std::vector<std::uint64_t> chain(std::uint64_t model_hash, std::span<const std::int32_t> tokens,
                                                        std::int64_t block_size, std::int64_t max_blocks);

  /// The longest cached run of `tokens`' leading full blocks, at most `max_blocks`; each block
  /// returned gains one reference (give it back with release()).
  [[nodiscard]] std::vector<Hit> acquire(std::span<const std::int32_t> tokens, std::int64_t max_blocks);
  /// Drops one reference from each key (as acquire() returned them, in that order); blocks left
  /// without a reference become the most recently used idle blocks.
  void release(std::span<const std::uint64_t> keys);

  /// Offers the blocks of a finished prompt: blocks[i] holds tokens [i*B, (i+1)*B) for i from
  /// `first_block`; only full blocks are offered. `payloads[i - first_block]` (possibly empty) is
  /// stored with block i. Blocks already cached under their key, whose parent is not cached, or
  /// that capacity has no idle block to displace for, are not taken. Returns the block ids the
  /// caller gets back: those not taken and idle ones displaced to stay within capacity.
  [[nodiscard]] std::vector<std::int32_t> insert(std::span<const std::int32_t> tokens, std::int64_t first_block,
                                                 std::span<const std::int32_t> blocks,
                                                 std::vector<std::vector<float>> payloads);
  /// Evicts up to `n` idle blocks, least recently used first, and returns their ids.
  [[nodiscard]] std::vector<std::int32_t> evict(std::int64_t n);

  [[nodiscard]] PrefixCacheStats stats() const;

 private:
  struct Entry {
    std::uint64_t parent = 0;
    std::vector<std::int32_t> tokens;
    std::int32_t block = 0;
    std::int64_t refs = 0;
    std::vector<float> payload;
    std::list<std::uint64_t>::iterator lru;  // valid while refs == 0
  };
  [[nodiscard]] const Entry* find(std::uint64_t key, std::uint64_t parent, std::span<const std::int32_t> block) const;

  const std::int64_t capacity_;
  const std::int64_t block_size_;
  const std::uint64_t model_hash_;
  KvEventLog* const events_;
  std::unordered_map<std::uint64_t, Entry> entries_;
  std::list<std::uint64_t> idle_;  // least recently used first
  std::int64_t evictions_ = 0;
};

}  // namespace pd::prefill
