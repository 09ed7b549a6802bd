#include "bpe.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <functional>

namespace pd::tokenizer::detail {
namespace {

constexpr std::uint32_t kNoRank = MergeTable::kNoRank;
// Pieces up to this many bytes merge with a linear scan; longer ones use a heap.
constexpr std::size_t kSmallPiece = 48;
// Pieces up to this many bytes are memoized per thread, in this many slots.
constexpr std::size_t kMemoPiece = 64;
constexpr std::size_t kMemoEntries = 4096;
std::atomic<std::uint64_t> next_instance{1};

std::size_t capacityFor(std::size_t count) {
  return std::bit_ceil(std::max<std::size_t>(16, count * 2));
}

}  // namespace

void MergeTable::reserve(std::size_t count) {
  slots_.assign(capacityFor(count), kEmpty);
  mask_ = slots_.size() - 1;
  size_ = 0;
}

bool MergeTable::insert(Id left, Id right, std::uint32_t rank) {
  PD_CHECK_MSG((size_ + 1) * 2 <= slots_.size(), "MergeTable over capacity");
  PD_CHECK(left < kMaxId && right < kMaxId && rank < (1u << 24));
  const std::uint64_t key = (static_cast<std::uint64_t>(left) << 20) | right;
  std::size_t slot = hash(key) & mask_;
  while (slots_[slot] != kEmpty) {
    if ((slots_[slot] >> 24) == key) return false;
    slot = (slot + 1) & mask_;
  }
  slots_[slot] = (key << 24) | rank;
  ++size_;
  return true;
}

std::uint64_t WordTable::hashOf(std::string_view word) {
  return std::hash<std::string_view>{}(word) | 1u;  // 0 marks an empty slot
}

void WordTable::reserve(std::size_t count) {
  slots_.assign(capacityFor(count), Slot{});
  mask_ = slots_.size() - 1;
  size_ = 0;
  arena_.clear();
}

void WordTable::insert(std::string_view word, Id id) {
  PD_CHECK_MSG((size_ + 1) * 2 <= slots_.size(), "WordTable over capacity");
  const std::uint64_t h = hashOf(word);
  std::size_t slot = static_cast<std::size_t>(h) & mask_;
  while (slots_[slot].hash != 0) {
    const Slot& s = slots_[slot];
    if (s.hash == h && std::string_view(arena_).substr(s.offset, s.length) == word) return;
    slot = (slot + 1) & mask_;
  }
  slots_[slot] = Slot{h, static_cast<std::uint32_t>(arena_.size()), static_cast<std::uint32_t>(word.size()), id};
  arena_.append(word);
  ++size_;
}

Id WordTable::find(std::string_view word, std::uint64_t h) const {
  std::size_t slot = static_cast<std::size_t>(h) & mask_;
  while (true) {
    const Slot& s = slots_[slot];
    if (s.hash == 0) return kNoId;
    if (s.hash == h && s.length == word.size() && std::string_view(arena_.data() + s.offset, s.length) == word) {
      return s.id;
    }
    slot = (slot + 1) & mask_;
  }
}

Result<BpeModel> BpeModel::create(const std::vector<std::string>& byte_level_bytes,
                                  const std::vector<MergeRule>& merges) {
  BpeModel model;
  model.instance_ = next_instance.fetch_add(1);
  model.byte_ids_.fill(kNoId);
  for (Id id = 0; id < byte_level_bytes.size(); ++id) {
    const std::string& bytes = byte_level_bytes[id];
    if (bytes.size() == 1) model.byte_ids_[static_cast<unsigned char>(bytes[0])] = id;
  }
  for (std::size_t b = 0; b < 256; ++b) {
    if (model.byte_ids_[b] == kNoId) {
      return makeError(ErrorCode::Unsupported,
                       "vocabulary has no token for byte " + std::to_string(b) + " (needed without byte_fallback/unk)");
    }
  }
  if (byte_level_bytes.size() >= MergeTable::kMaxId || merges.size() >= (1u << 24)) {
    return makeError(ErrorCode::Unsupported, "vocabulary or merge list too large (ids < 2^20, merges < 2^24)");
  }
  model.merges_.reserve(merges.size());
  model.merge_results_.assign(merges.size(), kNoId);
  for (std::size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& m = merges[rank];
    if (model.merges_.insert(m.left, m.right, static_cast<std::uint32_t>(rank))) model.merge_results_[rank] = m.result;
  }
  model.byte_pair_ranks_.resize(std::size_t{256} * 256);
  for (std::size_t b0 = 0; b0 < 256; ++b0) {
    for (std::size_t b1 = 0; b1 < 256; ++b1) {
      model.byte_pair_ranks_[b0 << 8 | b1] = model.merges_.rank(model.byte_ids_[b0], model.byte_ids_[b1]);
    }
  }
  // A piece spelled like a vocabulary token usually merges into exactly that token; finding
  // those once lets encode() answer them with one lookup.
  model.whole_words_.reserve(byte_level_bytes.size());
  BpeScratch scratch;
  std::vector<Id> ids;
  for (Id id = 0; id < byte_level_bytes.size(); ++id) {
    const std::string& bytes = byte_level_bytes[id];
    if (bytes.size() < 2) continue;
    ids.clear();
    if (bytes.size() <= kSmallPiece) {
      model.mergeByScan(bytes, scratch, ids);
    } else {
      model.mergeByHeap(bytes, scratch, ids);
    }
    if (ids.size() == 1 && ids[0] == id) model.whole_words_.insert(bytes, id);
  }
  return model;
}

void BpeModel::encode(std::string_view piece, BpeScratch& scratch, std::vector<Id>& out) const {
  if (piece.size() == 1) {
    out.push_back(byte_ids_[static_cast<unsigned char>(piece[0])]);
    return;
  }
  const std::uint64_t hash = WordTable::hashOf(piece);
  const Id whole = whole_words_.find(piece, hash);
  if (whole != kNoId) {
    out.push_back(whole);
    return;
  }
  if (piece.size() > kMemoPiece) {
    mergeByHeap(piece, scratch, out);
    return;
  }
  if (scratch.memo_owner != instance_) {
    scratch.memo.assign(kMemoEntries, BpeScratch::Memo{});
    scratch.memo_owner = instance_;
  }
  BpeScratch::Memo& memo = scratch.memo[(hash >> 7) & (kMemoEntries - 1)];
  if (memo.hash == hash && memo.piece == piece) {
    out.insert(out.end(), memo.ids.begin(), memo.ids.end());
    return;
  }
  const std::size_t first = out.size();
  if (piece.size() <= kSmallPiece) {
    mergeByScan(piece, scratch, out);
  } else {
    mergeByHeap(piece, scratch, out);
  }
  memo.hash = hash;
  memo.piece.assign(piece);
  memo.ids.assign(out.begin() + static_cast<std::ptrdiff_t>(first), out.end());
}

void BpeModel::mergeByScan(std::string_view piece, BpeScratch& scratch, std::vector<Id>& out) const {
  auto& sym = scratch.symbols;
  auto& rank = scratch.ranks;  // rank[k]: merge rank of (sym[k], sym[k+1])
  const std::size_t n0 = piece.size();
  sym.resize(n0);
  rank.resize(n0);
  for (std::size_t k = 0; k < n0; ++k) sym[k] = byte_ids_[static_cast<unsigned char>(piece[k])];
  auto& result = scratch.prev;  // result[k]: the token (sym[k], sym[k+1]) merges into
  result.resize(n0);
  const auto lookup = [&](std::size_t k) {
    rank[k] = merges_.rank(sym[k], sym[k + 1]);
    result[k] = rank[k] == kNoRank ? kNoId : merge_results_[rank[k]];
  };
  for (std::size_t k = 0; k + 1 < n0; ++k) {  // byte pairs: a direct table instead of the hash
    rank[k] = byte_pair_ranks_[static_cast<std::size_t>(static_cast<unsigned char>(piece[k])) << 8 |
                               static_cast<unsigned char>(piece[k + 1])];
    result[k] = rank[k] == kNoRank ? kNoId : merge_results_[rank[k]];
  }
  std::size_t n = n0;
  while (n > 1) {
    std::size_t best = 0;
    for (std::size_t k = 1; k + 1 < n; ++k) {
      if (rank[k] < rank[best]) best = k;
    }
    if (rank[best] == kNoRank) break;
    sym[best] = result[best];
    for (std::size_t k = best + 1; k + 1 < n; ++k) {
      sym[k] = sym[k + 1];
      rank[k] = rank[k + 1];
      result[k] = result[k + 1];
    }
    --n;
    if (best > 0) lookup(best - 1);
    if (best + 1 < n) lookup(best);
  }
  out.insert(out.end(), sym.begin(), sym.begin() + static_cast<std::ptrdiff_t>(n));
}

void BpeModel::mergeByHeap(std::string_view piece, BpeScratch& scratch, std::vector<Id>& out) const {
  // Symbols in a linked list; a min-heap of (rank, position) candidates, checked when popped.
  const std::size_t n = piece.size();
  auto& sym = scratch.symbols;
  auto& prev = scratch.prev;
  auto& next = scratch.next;
  auto& heap = scratch.heap;
  sym.resize(n);
  prev.resize(n);
  next.resize(n);
  heap.clear();
  constexpr std::uint32_t kNone = 0xFFFFFFFFu;
  for (std::size_t k = 0; k < n; ++k) {
    sym[k] = byte_ids_[static_cast<unsigned char>(piece[k])];
    prev[k] = k == 0 ? kNone : static_cast<std::uint32_t>(k - 1);
    next[k] = k + 1 == n ? kNone : static_cast<std::uint32_t>(k + 1);
  }
  const auto push = [&](std::uint32_t pos) {
    if (pos == kNone || next[pos] == kNone) return;
    const std::uint32_t r = merges_.rank(sym[pos], sym[next[pos]]);
    if (r == kNoRank) return;
    heap.push_back((static_cast<std::uint64_t>(r) << 32) | pos);
    std::push_heap(heap.begin(), heap.end(), std::greater<>{});
  };
  for (std::uint32_t k = 0; k + 1 < n; ++k) push(k);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), std::greater<>{});
    const std::uint64_t top = heap.back();
    heap.pop_back();
    const auto pos = static_cast<std::uint32_t>(top & 0xFFFFFFFFu);
    const auto want_rank = static_cast<std::uint32_t>(top >> 32);
    if (sym[pos] == kNoId || next[pos] == kNone) continue;              // merged away or now last
    if (merges_.rank(sym[pos], sym[next[pos]]) != want_rank) continue;  // a neighbour changed since the push
    const std::uint32_t right = next[pos];
    sym[pos] = merge_results_[want_rank];
    sym[right] = kNoId;
    next[pos] = next[right];
    if (next[right] != kNone) prev[next[right]] = pos;
    push(prev[pos]);
    push(pos);
  }
  for (std::uint32_t k = 0; k != kNone; k = next[k]) out.push_back(sym[k]);
}

}  // namespace pd::tokenizer::detail
