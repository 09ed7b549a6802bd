#pragma once
// Added tokens of tokenizer.json, found in raw text leftmost-longest (like Hugging Face's
// Aho-Corasick split). Thread rules: immutable after construction; find() is const.

#include <array>
#include <cstdint>
#include <string_view>
#include <utility>
#include <vector>

#include "bpe.h"

namespace pd::tokenizer::detail {

class AddedTokenMatcher {
 public:
  void add(std::string_view content, Id id);
  [[nodiscard]] bool empty() const { return nodes_.size() == 1; }

  struct Match {
    std::size_t begin = 0;
    std::size_t end = 0;
    Id id = kNoId;
  };
  /// The leftmost match in text[from..], longest among those starting there; id kNoId if none.
  [[nodiscard]] Match find(std::string_view text, std::size_t from) const;

 private:
  struct Node {
    std::vector<std::pair<unsigned char, std::uint32_t>> edges;  // sorted by byte
    Id id = kNoId;
  };
  [[nodiscard]] std::uint32_t child(std::uint32_t node, unsigned char byte) const;

  std::vector<Node> nodes_{1};
  std::array<bool, 256> first_byte_{};
};

}  // namespace pd::tokenizer::detail
