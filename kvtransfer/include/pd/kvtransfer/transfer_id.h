#pragma once
/// The id of one KV transfer (docs/kv-transfer.md, "Transfer ids"): 128 bits drawn from the
/// CSPRNG by the decode worker that opens the request, so that no client or peer can predict or
/// enumerate another request's id. Its text form, used in the worker API's JSON and in logs, is 32
/// lowercase hex digits, `hi` first. Logs and error messages show only its first 8 digits
/// (fmt's "{}"), so that a log line or an error reply never hands out a live id.
///
/// Thread rules: a value type; thread-safe.

#include <fmt/format.h>

#include <compare>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "pd/common/result.h"

namespace pd::kvtransfer {

struct TransferId {
  std::uint64_t hi = 0;
  std::uint64_t lo = 0;

  /// Characters of the text form.
  static constexpr std::size_t kHexChars = 32;

  /// 128 bits of CSPRNG output (libcrypto's RAND_bytes); never the all-zero id.
  [[nodiscard]] static TransferId random();
  /// Parses the text form. Hostile input is expected: InvalidArgument unless `hex` is exactly 32
  /// lowercase hex digits (so that one id has one text form).
  [[nodiscard]] static Result<TransferId> fromHex(std::string_view hex);
  /// The text form: 32 lowercase hex digits.
  [[nodiscard]] std::string hex() const;
  /// The first 8 hex digits: enough to correlate log lines, too few to act on.
  [[nodiscard]] std::string shortHex() const { return hex().substr(0, 8); }
  [[nodiscard]] bool empty() const { return hi == 0 && lo == 0; }

  friend bool operator==(const TransferId&, const TransferId&) = default;
  // NOLINTNEXTLINE(modernize-use-nullptr): clang-tidy misreads a defaulted <=> (the 0 it compares with)
  friend auto operator<=>(const TransferId&, const TransferId&) = default;
};

/// For unordered containers. The ids are uniformly random, so mixing the halves suffices.
struct TransferIdHash {
  std::size_t operator()(const TransferId& id) const noexcept {
    return static_cast<std::size_t>(id.hi ^ (id.lo * 0x9E3779B97F4A7C15ULL));
  }
};

}  // namespace pd::kvtransfer

template <>
struct std::hash<pd::kvtransfer::TransferId> : pd::kvtransfer::TransferIdHash {};

/// "{}" prints the short form (TransferId::shortHex).
template <>
struct fmt::formatter<pd::kvtransfer::TransferId> : fmt::formatter<std::string_view> {
  auto format(const pd::kvtransfer::TransferId& id, fmt::format_context& ctx) const {
    const std::string text = id.shortHex();
    return fmt::formatter<std::string_view>::format(text, ctx);
  }
};
