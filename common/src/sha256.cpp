// SHA-256 (sha256.h) on OpenSSL's libcrypto (EVP), plus file hashing.
#include "pd/common/sha256.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <openssl/evp.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "pd/common/check.h"
#include "pd/common/crypto.h"

namespace pd {

namespace {

class ScopedFd {
 public:
  explicit ScopedFd(int fd) : fd_(fd) {}
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;
  ~ScopedFd() {
    if (fd_ >= 0) ::close(fd_);
  }
  [[nodiscard]] int get() const { return fd_; }

 private:
  int fd_;
};

}  // namespace

void Sha256::CtxDeleter::operator()(evp_md_ctx_st* ctx) const noexcept {
  EVP_MD_CTX_free(ctx);
}

Sha256::Sha256() : ctx_(EVP_MD_CTX_new()) {
  PD_CHECK_MSG(ctx_ != nullptr && EVP_DigestInit_ex(ctx_.get(), EVP_sha256(), nullptr) == 1,
               "SHA-256: EVP_DigestInit_ex failed");
}

void Sha256::update(std::span<const std::byte> bytes) {
  PD_CHECK_MSG(!finished_, "Sha256::update() after finish()");
  if (bytes.empty()) return;
  PD_CHECK_MSG(EVP_DigestUpdate(ctx_.get(), bytes.data(), bytes.size()) == 1, "SHA-256: EVP_DigestUpdate failed");
}

std::array<std::uint8_t, 32> Sha256::finish() {
  PD_CHECK_MSG(!finished_, "Sha256::finish() called twice");
  finished_ = true;
  std::array<std::uint8_t, 32> digest{};
  unsigned int len = 0;
  PD_CHECK_MSG(EVP_DigestFinal_ex(ctx_.get(), digest.data(), &len) == 1 && len == digest.size(),
               "SHA-256: EVP_DigestFinal_ex failed");
  return digest;
}

std::string Sha256::finishHex() {
  return crypto::toHex(finish());
}

std::string sha256Hex(std::span<const std::byte> bytes) {
  Sha256 hasher;
  hasher.update(bytes);
  return hasher.finishHex();
}

Result<std::string> sha256File(const std::filesystem::path& path) {
  const ScopedFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) {
    const int err = errno;
    return makeError(err == ENOENT ? ErrorCode::NotFound : ErrorCode::Io,
                     fmt::format("{}: cannot open: {}", path.string(), std::strerror(err)));
  }
  Sha256 hasher;
  std::vector<std::byte> chunk(1 << 20);
  for (;;) {
    const ssize_t got = ::read(fd.get(), chunk.data(), chunk.size());
    if (got < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      return makeError(ErrorCode::Io, fmt::format("{}: read failed: {}", path.string(), std::strerror(err)));
    }
    if (got == 0) break;
    hasher.update(std::span<const std::byte>(chunk.data(), static_cast<std::size_t>(got)));
  }
  return hasher.finishHex();
}

}  // namespace pd
