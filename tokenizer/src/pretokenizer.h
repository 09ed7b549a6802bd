#pragma once
// The pre-tokenizer of tokenizer.json: a Sequence of regex Splits (behavior Isolated) then
// ByteLevel without its own regex. Each Split pattern DeepSeek-V3 uses is matched by hand-written
// code that reproduces the Oniguruma regex exactly (first alternative that matches wins, greedy
// quantifiers with backtracking), on Unicode 16.0 classes. Other patterns are Unsupported.
// Thread rules: immutable after fromJson(); split() is const and re-entrant (caller's scratch).

#include <boost/json/value.hpp>
#include <cstdint>
#include <string_view>
#include <vector>

#include "pd/common/result.h"

namespace pd::tokenizer::detail {

enum class SplitPattern {
  NumberGroups,   // \p{N}{1,3}
  CjkRuns,        // [一-龥぀-ゟ゠-ヿ]+
  DeepSeekWords,  // the word / punctuation / whitespace alternation of DeepSeek-V3
};

/// A piece of the input, as byte offsets [begin, end).
struct Piece {
  std::uint32_t begin;
  std::uint32_t end;
};

/// Per-call working memory, reused across calls by one thread.
struct PreTokenizerScratch {
  std::vector<std::uint16_t> flags;    // character class bits per code point
  std::vector<std::uint32_t> offsets;  // byte offset of each code point, plus the end
};

class PreTokenizer {
 public:
  /// From tokenizer.json's "pre_tokenizer" object. Unsupported for anything else than Splits
  /// with the known patterns (Isolated, not inverted) followed by ByteLevel(add_prefix_space:
  /// false, use_regex: false).
  [[nodiscard]] static Result<PreTokenizer> fromJson(const boost::json::value& pre_tokenizer);

  /// Appends the pieces of `text` (valid UTF-8, at most 4 GiB) to `out`, in order; together
  /// they cover `text` exactly.
  void split(std::string_view text, PreTokenizerScratch& scratch, std::vector<Piece>& out) const;

 private:
  explicit PreTokenizer(std::vector<SplitPattern> splits) : splits_(std::move(splits)) {}
  std::vector<SplitPattern> splits_;
};

}  // namespace pd::tokenizer::detail
