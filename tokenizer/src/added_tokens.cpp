#include "added_tokens.h"

#include <algorithm>

namespace pd::tokenizer::detail {
namespace {
constexpr std::uint32_t kNoNode = 0;  // the root is never a child
}  // namespace

std::uint32_t AddedTokenMatcher::child(std::uint32_t node, unsigned char byte) const {
  const auto& edges = nodes_[node].edges;
  const auto it = std::lower_bound(edges.begin(), edges.end(), byte,
                                   [](const auto& edge, unsigned char b) { return edge.first < b; });
  return it != edges.end() && it->first == byte ? it->second : kNoNode;
}

void AddedTokenMatcher::add(std::string_view content, Id id) {
  if (content.empty()) return;
  first_byte_[static_cast<unsigned char>(content[0])] = true;
  std::uint32_t node = 0;
  for (const char ch : content) {
    const auto byte = static_cast<unsigned char>(ch);
    std::uint32_t next = child(node, byte);
    if (next == kNoNode) {
      next = static_cast<std::uint32_t>(nodes_.size());
      nodes_.emplace_back();
      auto& edges = nodes_[node].edges;
      const auto it = std::lower_bound(edges.begin(), edges.end(), byte,
                                       [](const auto& edge, unsigned char b) { return edge.first < b; });
      edges.insert(it, {byte, next});
    }
    node = next;
  }
  if (nodes_[node].id == kNoId) nodes_[node].id = id;
}

AddedTokenMatcher::Match AddedTokenMatcher::find(std::string_view text, std::size_t from) const {
  for (std::size_t pos = from; pos < text.size(); ++pos) {
    if (!first_byte_[static_cast<unsigned char>(text[pos])]) continue;
    Match best;
    std::uint32_t node = 0;
    for (std::size_t k = pos; k < text.size(); ++k) {
      node = child(node, static_cast<unsigned char>(text[k]));
      if (node == kNoNode) break;
      if (nodes_[node].id != kNoId) best = Match{pos, k + 1, nodes_[node].id};
    }
    if (best.id != kNoId) return best;
  }
  return Match{text.size(), text.size(), kNoId};
}

}  // namespace pd::tokenizer::detail
