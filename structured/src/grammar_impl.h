#pragma once
// Grammar's insides, shared with the Matcher. Private to pd_structured.

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "automaton.h"
#include "pd/structured/grammar.h"

namespace pd::structured {

/// The plain tokens (vocabulary_impl.h) a pattern string takes from one DFA state, by how many
/// characters each needs: its own plus the fewest the pattern then needs to accept. A plain token
/// never closes the string, so from that state with `room` characters left it is allowed exactly
/// when its need is at most `room`.
struct PatternStateMask {
  std::vector<MaskWord> all;            // every plain token the state takes (for no limit)
  std::vector<TokenId> by_need;         // those tokens sorted by need
  std::vector<std::uint32_t> need_end;  // [k]: tokens in by_need with need <= k
};

class Grammar::Impl {
 public:
  std::shared_ptr<const TokenVocabulary> vocabulary;
  detail::Automaton automaton;
  GrammarOptions options;

  /// The mask of (pattern, DFA state), computed on first use (a pass over the plain tokens, a few
  /// milliseconds) and kept for every Matcher of this grammar; nullptr once kMaxCachedStates are
  /// kept (a schema from the network must not grow this without bound: the caller then walks the
  /// trie instead). Thread-safe.
  std::shared_ptr<const PatternStateMask> patternMask(std::int32_t pattern, std::uint32_t state) const;

 private:
  static constexpr std::size_t kMaxCachedStates = 64;
  mutable std::mutex cache_mutex_;
  mutable std::map<std::pair<std::int32_t, std::uint32_t>, std::shared_ptr<const PatternStateMask>> cache_;
};

}  // namespace pd::structured
