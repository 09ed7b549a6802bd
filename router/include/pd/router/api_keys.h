#pragma once
/// The Bearer keys the router accepts. Keys are kept only as SHA-256 digests and a presented key
/// is compared against every one of them in constant time (no early exit on the first differing
/// byte or the first matching key), so response timing reveals nothing about the keys.
///
/// Key file: one key per line; blank lines and lines starting with '#' are skipped; surrounding
/// whitespace is trimmed. A key is the line's first word (Bearer keys hold no whitespace); it may
/// be followed by optional limits (key_limits.h), in any order, and a trailing '#' comment:
///
///   sk-team-a  max_concurrent=4 tokens_per_minute=200000
///   sk-team-b  # no limits
///
/// Errors: NotFound / Io reading the file; InvalidArgument for a file with no keys (an empty key
/// file most likely is a mistake, and would silently disable auth), a key listed twice, or a
/// field after the key that is not one of the limits with a positive integer value. Messages
/// name the line, never a key.
///
/// Thread rules: immutable after construction; the lookups are thread-safe.

#include <array>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "pd/common/result.h"
#include "pd/router/key_limits.h"

namespace pd::router {

/// One accepted key and its limits.
struct ApiKey {
  std::string key;
  KeyLimits limits;
};

class ApiKeySet {
 public:
  /// No keys: every request is accepted.
  ApiKeySet() = default;
  /// Keys without limits.
  explicit ApiKeySet(const std::vector<std::string>& keys);
  /// Keys with their limits; a key listed twice is found at its first entry.
  [[nodiscard]] static ApiKeySet withLimits(const std::vector<ApiKey>& keys);
  [[nodiscard]] static Result<ApiKeySet> fromFile(const std::filesystem::path& path);

  /// True when no key is configured (authentication is off).
  [[nodiscard]] bool empty() const { return digests_.empty(); }
  [[nodiscard]] std::size_t size() const { return digests_.size(); }
  /// True if `key` is one of the keys.
  [[nodiscard]] bool accepts(std::string_view key) const { return find(key).has_value(); }
  /// Checks an `Authorization` header value: "Bearer <key>" (scheme case-insensitive).
  [[nodiscard]] bool acceptsAuthorization(std::string_view header_value) const {
    return findAuthorization(header_value).has_value();
  }
  /// The index of `key` (file order), or nullopt; the same work whichever key matches, if any.
  [[nodiscard]] std::optional<std::size_t> find(std::string_view key) const;
  /// find() for an `Authorization` header value.
  [[nodiscard]] std::optional<std::size_t> findAuthorization(std::string_view header_value) const;
  /// Every key's limits, by index (what KeyLimiter takes).
  [[nodiscard]] const std::vector<KeyLimits>& limits() const { return limits_; }

 private:
  using Digest = std::array<std::uint8_t, 32>;
  std::vector<Digest> digests_;
  std::vector<KeyLimits> limits_;  // parallel to digests_
};

}  // namespace pd::router
