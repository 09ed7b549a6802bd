#pragma once
/// The Bearer keys the router accepts. Keys are kept only as SHA-256 digests and a presented key
/// is compared against every one of them in constant time (no early exit on the first differing
/// byte or the first matching key), so response timing reveals nothing about the keys.
///
/// Key file: one key per line; blank lines and lines starting with '#' are skipped; surrounding
/// whitespace is trimmed. Errors: NotFound / Io reading the file, InvalidArgument for a file
/// with no keys (an empty key file most likely is a mistake, and would silently disable auth).
///
/// Thread rules: immutable after construction; accepts() is thread-safe.

#include <array>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "pd/common/result.h"

namespace pd::router {

class ApiKeySet {
 public:
  /// No keys: every request is accepted.
  ApiKeySet() = default;
  explicit ApiKeySet(const std::vector<std::string>& keys);
  [[nodiscard]] static Result<ApiKeySet> fromFile(const std::filesystem::path& path);

  /// True when no key is configured (authentication is off).
  [[nodiscard]] bool empty() const { return digests_.empty(); }
  [[nodiscard]] std::size_t size() const { return digests_.size(); }
  /// True if `key` is one of the keys.
  [[nodiscard]] bool accepts(std::string_view key) const;
  /// Checks an `Authorization` header value: "Bearer <key>" (scheme case-insensitive).
  [[nodiscard]] bool acceptsAuthorization(std::string_view header_value) const;

 private:
  using Digest = std::array<std::uint8_t, 32>;
  std::vector<Digest> digests_;
};

}  // namespace pd::router
