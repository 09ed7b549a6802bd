#pragma once
/// Cryptographic primitives, all from OpenSSL's libcrypto: HMAC-SHA-256, constant-time
/// comparison, random bytes from the operating system's CSPRNG, and hex codecs.
///
/// Thread rules: pure functions, thread-safe.

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "pd/common/result.h"

namespace pd::crypto {

using Digest = std::array<std::uint8_t, 32>;

/// HMAC-SHA-256 of `data` under `key` (RFC 2104).
[[nodiscard]] Digest hmacSha256(std::span<const std::uint8_t> key, std::span<const std::byte> data);
[[nodiscard]] Digest hmacSha256(std::span<const std::uint8_t> key, std::string_view data);

/// True when both spans hold the same bytes; the time taken depends only on the lengths.
[[nodiscard]] bool constantTimeEqual(std::span<const std::uint8_t> a, std::span<const std::uint8_t> b);

/// `n` bytes from the CSPRNG. A CSPRNG that fails is an invariant violation (PD_CHECK).
[[nodiscard]] std::vector<std::uint8_t> randomBytes(std::size_t n);
/// 128 random bits as 32 lowercase hex characters (request and transfer ids).
[[nodiscard]] std::string randomHex128();

[[nodiscard]] std::string toHex(std::span<const std::uint8_t> bytes);
/// InvalidArgument unless `hex` is an even number of hex digits.
[[nodiscard]] Result<std::vector<std::uint8_t>> fromHex(std::string_view hex);

}  // namespace pd::crypto
