#pragma once
/// SHA-256 (FIPS 180-4, computed by OpenSSL's libcrypto), used to fingerprint checkpoints and
/// other artifacts.
/// Thread rules: the free functions are pure and thread-safe; one Sha256 object must not be
/// used by two threads at once.

#include <array>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>

#include "pd/common/result.h"

// OpenSSL's EVP_MD_CTX, kept out of this header.
struct evp_md_ctx_st;

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
  struct CtxDeleter {
    void operator()(evp_md_ctx_st* ctx) const noexcept;
  };
  std::unique_ptr<evp_md_ctx_st, CtxDeleter> ctx_;
  bool finished_ = false;
};

/// Lowercase hex SHA-256 of `bytes`.
[[nodiscard]] std::string sha256Hex(std::span<const std::byte> bytes);

/// Lowercase hex SHA-256 of a file's contents, read in chunks (constant memory).
/// NotFound if the file does not exist, Io if it cannot be opened or read.
[[nodiscard]] Result<std::string> sha256File(const std::filesystem::path& path);

}  // namespace pd
