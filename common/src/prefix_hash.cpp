#include "pd/common/prefix_hash.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>

namespace pd {
namespace {

// splitmix64's finalizer: spreads every input bit over the output.
std::uint64_t mix(std::uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

}  // namespace

std::uint64_t prefixBlockKey(std::uint64_t parent, std::span<const std::int32_t> tokens) {
  std::uint64_t h = mix(parent ^ 0x9e3779b97f4a7c15ULL);
  for (const std::int32_t t : tokens) h = mix(h ^ static_cast<std::uint32_t>(t)) + 0x9e3779b97f4a7c15ULL;
  return mix(h ^ tokens.size());
}

std::vector<std::uint64_t> prefixHashChain(std::uint64_t model_hash, std::span<const std::int32_t> tokens,
                                           std::int64_t block_size, std::int64_t max_blocks) {
  std::vector<std::uint64_t> keys;
  if (block_size <= 0) return keys;
  const std::int64_t full = std::min(static_cast<std::int64_t>(tokens.size()) / block_size, max_blocks);
  keys.reserve(static_cast<std::size_t>(std::max<std::int64_t>(full, 0)));
  std::uint64_t parent = model_hash;
  for (std::int64_t i = 0; i < full; ++i) {
    parent = prefixBlockKey(
        parent, tokens.subspan(static_cast<std::size_t>(i * block_size), static_cast<std::size_t>(block_size)));
    keys.push_back(parent);
  }
  return keys;
}

std::string hash64Hex(std::uint64_t value) {
  return fmt::format("{:016x}", value);
}

std::optional<std::uint64_t> parseHash64Hex(std::string_view text) {
  if (text.size() != 16) return std::nullopt;
  std::uint64_t value = 0;
  const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value, 16);
  if (ec != std::errc() || ptr != text.data() + text.size()) return std::nullopt;
  return value;
}

}  // namespace pd
