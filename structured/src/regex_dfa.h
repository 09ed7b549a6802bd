#pragma once
// A JSON Schema `pattern` (the subset of docs/structured-outputs.md) compiled to a DFA over Unicode
// code points. Private to pd_structured.

#include <cstdint>
#include <string_view>
#include <vector>

#include "pd/common/result.h"

namespace pd::structured::detail {

struct RegexDfa {
  static constexpr std::uint32_t kNone = UINT32_MAX;
  struct Edge {
    std::uint32_t lo;  // code points lo..hi (inclusive)
    std::uint32_t hi;
    std::uint32_t target;
  };
  std::vector<std::vector<Edge>> edges;  // per state, sorted by lo, disjoint
  std::vector<std::uint8_t> accepting;
  std::vector<std::uint32_t> dist;  // fewest characters to an accepting state; kNone if none
  std::uint32_t start = 0;

  /// The state after `cp`, or kNone.
  [[nodiscard]] std::uint32_t next(std::uint32_t q, std::uint32_t cp) const;
};

/// Compiles an ECMA-262 style pattern with JSON Schema's search semantics (unanchored unless it
/// starts with ^ / ends with $). Unsupported naming the construct for anything outside the subset.
[[nodiscard]] Result<RegexDfa> compileRegex(std::string_view pattern);

}  // namespace pd::structured::detail
