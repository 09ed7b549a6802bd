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
/// The next token: a cached block also records the token that followed it (the first token of
/// the next block, or the first sampled token for a prompt's last full block). The main layers'
/// KV of a block depends only on the tokens up to its end, but the MTP layer's latent at its last
/// position is computed from the token after it. A block matches only a prompt whose token after
/// it is the same, so every cached block's MTP layer is exact for the prompt that reuses it, and
/// the MTP pass need not recompute cached blocks. One key may therefore be cached in several
/// variants, one per next token (a shared system prompt followed by different conversations).
///
/// Ownership: the cache holds block ids it took from insert() until evict() hands them back.
/// Each held block has a reference count (the running requests that acquire()d it); blocks with
/// no reference are idle and ordered least recently used first. Capacity bounds the blocks held
/// (idle or referenced); eviction takes idle blocks only, leaves of a chain before their parents
/// when they were used together.
///
/// Events: with a KvEventLog, a key is reported stored() when its first variant enters the cache
/// and removed() when its last one leaves (evicted or displaced), so routers can follow what it
/// holds.
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
    std::uint64_t entry = 0;  ///< names this cached variant for release()
    std::int32_t block = 0;
  };

  /// `capacity_blocks` > 0 and `block_size` > 0 (checked by the caller's options). `events`
  /// (optional) must outlive the cache.
  PrefixCache(std::int64_t capacity_blocks, std::int64_t block_size, std::uint64_t model_hash,
              KvEventLog* events = nullptr);

  /// The hash chain of the first `max_blocks` full blocks of `tokens` (prefix_hash.h).
  [[nodiscard]] static std::vector<std::uint64_t> chain(std::uint64_t model_hash, std::span<const std::int32_t> tokens,
                                                        std::int64_t block_size, std::int64_t max_blocks);

  /// The longest cached run of `tokens`' leading full blocks that are followed by a token in
  /// `tokens` (each matched with that next token), at most `max_blocks`; each block returned
  /// gains one reference (give it back with release()).
  [[nodiscard]] std::vector<Hit> acquire(std::span<const std::int32_t> tokens, std::int64_t max_blocks);
  /// Drops one reference from each entry (as acquire() returned them, in that order); blocks
  /// left without a reference become the most recently used idle blocks.
  void release(std::span<const std::uint64_t> entries);

  /// Offers the blocks of a finished prompt: blocks[i] holds tokens [i*B, (i+1)*B) for i from
  /// `first_block`, and `tokens` is the prompt followed by its first sampled token, so that each
  /// offered block has its next token; only full blocks followed by a token are offered. Blocks
  /// already cached with the same next token, whose parent is not cached, whose key another
  /// prefix holds (a hash collision) or that capacity has no idle block to displace for, are not
  /// taken. Returns the block ids the caller gets back: those not taken and idle ones displaced
  /// to stay within capacity.
  [[nodiscard]] std::vector<std::int32_t> insert(std::span<const std::int32_t> tokens, std::int64_t first_block,
                                                 std::span<const std::int32_t> blocks);
  /// Evicts up to `n` idle blocks, least recently used first, and returns their ids.
  [[nodiscard]] std::vector<std::int32_t> evict(std::int64_t n);

  [[nodiscard]] PrefixCacheStats stats() const;

 private:
  struct Entry {
    std::uint64_t key = 0;
    std::uint64_t parent = 0;
    std::vector<std::int32_t> tokens;
    std::int32_t next = 0;  // the token after the block
    std::int32_t block = 0;
    std::int64_t refs = 0;
    std::list<std::uint64_t>::iterator lru;  // valid while refs == 0
  };
  // The entry caching `block` tokens under `key` and `parent` followed by `next`; 0 if none.
  [[nodiscard]] std::uint64_t find(std::uint64_t key, std::uint64_t parent, std::span<const std::int32_t> block,
                                   std::int32_t next) const;
  // Whether `key` is cached for other tokens or another parent (a hash collision).
  [[nodiscard]] bool collides(std::uint64_t key, std::uint64_t parent, std::span<const std::int32_t> block) const;
  void erase(std::uint64_t id);  // drops an idle entry; the caller takes its block

  const std::int64_t capacity_;
  const std::int64_t block_size_;
  const std::uint64_t model_hash_;
  KvEventLog* const events_;
  std::unordered_map<std::uint64_t, Entry> entries_;                      // by entry id
  std::unordered_map<std::uint64_t, std::vector<std::uint64_t>> by_key_;  // key -> its variants' ids
  std::list<std::uint64_t> idle_;                                         // entry ids, least recently used first
  std::uint64_t next_id_ = 1;
  std::int64_t evictions_ = 0;
};

}  // namespace pd::prefill
