#pragma once
/// Choices of one generation (OpenAI `n`): how many the workers accept and how each one's seed is
/// derived (docs/api.md, "n"; docs/kv-memory.md, "Choices share the prompt").
///
/// Thread rules: constants and pure functions.

#include <cstdint>

namespace pd {

/// Most choices one generation may ask the workers for; the router's own cap (router.max_n) is
/// at most this.
inline constexpr std::int64_t kMaxChoices = 128;

/// The seed of choice `choice` (0-based) of a generation seeded `seed`: choice 0 keeps `seed`
/// itself, so its tokens are the n = 1 answer's; choice i > 0 takes splitmix64's finalizer of
/// seed + i * 0x9E3779B97F4A7C15 (the golden-ratio increment splitmix64 steps by), so the
/// choices' streams differ and each is reproducible alone: a choice resumed as an n = 1
/// generation with this seed samples what it would have sampled.
[[nodiscard]] constexpr std::uint64_t choiceSeed(std::uint64_t seed, std::int64_t choice) {
  if (choice <= 0) return seed;
  std::uint64_t z = seed + static_cast<std::uint64_t>(choice) * 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30U)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27U)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31U);
}

}  // namespace pd
