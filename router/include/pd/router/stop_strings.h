#pragma once
/// Stop strings over streamed text: the output ends right before the first occurrence of any
/// stop string, and nothing that might still turn out to be the start of one is released early.
/// Text is held back while its end is a prefix of some stop string, so streamed and whole
/// responses end at the same byte.
///
/// Thread rules: one object per generation, one thread at a time.

#include <string>
#include <string_view>
#include <vector>

namespace pd::router {

class StopStringMatcher {
 public:
  /// Empty strings are ignored. With `include_match` the released text ends right after the
  /// matched stop string instead of right before it.
  explicit StopStringMatcher(std::vector<std::string> stops, bool include_match = false);

  struct Step {
    std::string text;      ///< text now safe to release
    bool matched = false;  ///< a stop string matched: `text` ends right before (or after) it; stop here
  };
  /// Adds the next piece of output text.
  [[nodiscard]] Step push(std::string_view piece);
  /// The held-back text, released at the end of a generation without a match.
  [[nodiscard]] std::string flush();
  [[nodiscard]] bool empty() const { return stops_.empty(); }

 private:
  std::vector<std::string> stops_;
  bool include_match_ = false;
  std::string held_;  // unreleased text: a possible prefix of a stop string
  bool matched_ = false;
};

}  // namespace pd::router
