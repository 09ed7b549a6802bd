#pragma once
/// SHA-256 (FIPS 180-4), used to fingerprint checkpoints and other artifacts.
/// Thread rules: the free functions are pure and thread-safe; one Sha256 object must not be
/// used by two threads at once.

#include <array>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>

#include "pd/common/result.h"

namespace pd {

/// Incremental SHA-256. Feed bytes with update(), then call finish() once; the object is spent
/// after finish() (calling update() or finish() again is a PD_CHECK failure).
class Sha256 {
 public:
  Sha256();

  void update(std::span<const std::byte> bytes);
  /// The 32-byte digest.
  [[nodiscard]] std::array<std::uint8_t, 32> finish();
  /// The digest as 64 lowercase hex characters.
  [[nodiscard]] std::string finishHex();

 private:
  void compress(const std::uint8_t* block);

  std::array<std::uint32_t, 8> state_;
  std::array<std::uint8_t, 64> buffer_{};
  std::size_t buffered_ = 0;
  std::uint64_t total_bytes_ = 0;
  bool finished_ = false;
};

/// Lowercase hex SHA-256 of `bytes`.
[[nodiscard]] std::string sha256Hex(std::span<const std::byte> bytes);

/// Lowercase hex SHA-256 of a file's contents, read in chunks (constant memory).
/// NotFound if the file does not exist, Io if it cannot be opened or read.
[[nodiscard]] Result<std::string> sha256File(const std::filesystem::path& path);

}  // namespace pd
