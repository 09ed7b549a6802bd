#pragma once
/// The prefix hash chain (docs/kv-memory.md, "The prefill prefix cache"; docs/routing.md): block i
/// of a prompt is keyed by h_i = H(h_{i-1}, tokens of block i), with h_{-1} = the model hash, so a
/// key names a whole prefix on one model. The prefill worker's prefix cache keys its blocks with
/// it and publishes them in KV events; the router computes the same chain over a prompt to find
/// the worker holding its longest prefix. One definition, here, so the two cannot drift.
///
/// A key is only an index: the prefix cache also compares a block's tokens on every match, and the
/// router only uses keys to choose a worker (a collision costs a cache miss, never wrong KV).
///
/// Thread rules: pure functions; thread-safe.

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace pd {

/// The key of a block of `tokens` whose preceding prefix has key `parent`.
[[nodiscard]] std::uint64_t prefixBlockKey(std::uint64_t parent, std::span<const std::int32_t> tokens);

/// The keys of the first min(tokens.size() / block_size, max_blocks) full blocks of `tokens`,
/// chained from `model_hash`. `block_size` > 0.
[[nodiscard]] std::vector<std::uint64_t> prefixHashChain(std::uint64_t model_hash, std::span<const std::int32_t> tokens,
                                                         std::int64_t block_size, std::int64_t max_blocks);

/// A 64-bit hash as 16 lower-case hex digits (the wire form of block keys and model hashes).
[[nodiscard]] std::string hash64Hex(std::uint64_t value);
/// The reverse of hash64Hex: exactly 16 hex digits (either case); nullopt otherwise.
[[nodiscard]] std::optional<std::uint64_t> parseHash64Hex(std::string_view text);

}  // namespace pd
