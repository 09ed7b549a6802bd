#pragma once
// Byte-level BPE over raw bytes: each byte starts as its single-byte token, then adjacent pairs
// merge by rank (lowest first, leftmost among equal ranks), as Hugging Face's BPE model does.
// Pieces that are themselves a vocabulary token that BPE reproduces are looked up directly.
// Thread rules: immutable after create(); encode() is const and re-entrant.

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "pd/common/result.h"

namespace pd::tokenizer::detail {

using Id = std::uint32_t;
constexpr Id kNoId = 0xFFFFFFFFu;

/// Open-addressing map from a token pair to the merge's rank, 8 bytes a slot (ids and ranks
/// below 2^20) so the hot table stays small; the merged token is looked up by rank.
class MergeTable {
 public:
  static constexpr std::uint32_t kMaxId = 1u << 20;
  static constexpr std::uint32_t kNoRank = 0xFFFFFFFFu;
  void reserve(std::size_t count);
  /// False if the pair is already present (first one wins).
  bool insert(Id left, Id right, std::uint32_t rank);
  /// Rank of the merge (left, right), or kNoRank.
  [[nodiscard]] std::uint32_t rank(Id left, Id right) const {
    const std::uint64_t key = (static_cast<std::uint64_t>(left) << 20) | right;
    std::size_t slot = hash(key) & mask_;
    while (true) {
      const std::uint64_t s = slots_[slot];
      if ((s >> 24) == key) return static_cast<std::uint32_t>(s & 0xFFFFFF);
      if (s == kEmpty) return kNoRank;
      slot = (slot + 1) & mask_;
    }
  }

 private:
  static constexpr std::uint64_t kEmpty = ~std::uint64_t{0};  // key bits all ones: never a valid pair
  static std::size_t hash(std::uint64_t key) {
    std::uint64_t h = key * 0x9E3779B97F4A7C15ull;
    return static_cast<std::size_t>(h ^ (h >> 29));
  }
  std::vector<std::uint64_t> slots_{kEmpty};  // key (40 bits) << 24 | rank (24 bits)
  std::size_t mask_ = 0;
  std::size_t size_ = 0;
};

/// Open-addressing map from a byte string (stored in the map) to an id.
class WordTable {
 public:
  void reserve(std::size_t count);
  void insert(std::string_view word, Id id);
  [[nodiscard]] Id find(std::string_view word) const { return find(word, hashOf(word)); }
  [[nodiscard]] Id find(std::string_view word, std::uint64_t hash) const;
  static std::uint64_t hashOf(std::string_view word);

 private:
  struct Slot {
    std::uint64_t hash = 0;
    std::uint32_t offset = 0;
    std::uint32_t length = 0;
    Id id = kNoId;
  };
  std::vector<Slot> slots_{1};
  std::string arena_;
  std::size_t mask_ = 0;
  std::size_t size_ = 0;
};

/// Working memory of encode calls on one thread, and a memo of recently merged pieces (results
/// never depend on it: BPE is a pure function of the piece).
struct BpeScratch {
  std::vector<Id> symbols;
  std::vector<std::uint32_t> ranks;
  std::vector<std::uint32_t> prev;
  std::vector<std::uint32_t> next;
  std::vector<std::uint64_t> heap;

  struct Memo {
    std::uint64_t hash = 0;
    std::string piece;
    std::vector<Id> ids;
  };
  std::uint64_t memo_owner = 0;  // the BpeModel the memo belongs to
  std::vector<Memo> memo;        // direct-mapped by hash
};

class BpeModel {
 public:
  struct MergeRule {
    Id left;
    Id right;
    Id result;
  };
  /// `byte_level_bytes[id]` are the raw bytes of vocabulary id `id` when its string is spelled
  /// in the byte-level alphabet, else empty; `merges` in rank order. Corrupt if a byte has no
  /// single-byte token.
  [[nodiscard]] static Result<BpeModel> create(const std::vector<std::string>& byte_level_bytes,
                                               const std::vector<MergeRule>& merges);

  /// Appends the ids of one pre-tokenizer piece (non-empty raw bytes).
  void encode(std::string_view piece, BpeScratch& scratch, std::vector<Id>& out) const;

  /// The two merge loops encode() picks between by piece length (public for tests): a linear
  /// scan for the lowest rank (short pieces) and a heap over a linked list (long ones).
  void mergeByScan(std::string_view piece, BpeScratch& scratch, std::vector<Id>& out) const;
  void mergeByHeap(std::string_view piece, BpeScratch& scratch, std::vector<Id>& out) const;

 private:
  BpeModel() = default;

  std::uint64_t instance_ = 0;  // unique per model, keys the per-thread memo
  std::array<Id, 256> byte_ids_{};
  MergeTable merges_;
  std::vector<Id> merge_results_;               // by rank
  std::vector<std::uint32_t> byte_pair_ranks_;  // rank of (byte token, byte token), by (b0 << 8 | b1)
  WordTable whole_words_;                       // pieces whose BPE result is one token
};

}  // namespace pd::tokenizer::detail
