// libcrypto-backed primitives (crypto.h).
#include "pd/common/crypto.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include "pd/common/check.h"

namespace pd::crypto {

Digest hmacSha256(std::span<const std::uint8_t> key, std::span<const std::byte> data) {
  Digest out{};
  unsigned int len = 0;
  const unsigned char* r = HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
                                reinterpret_cast<const unsigned char*>(data.data()), data.size(), out.data(), &len);
  PD_CHECK_MSG(r != nullptr && len == out.size(), "HMAC-SHA-256 failed");
  return out;
}

Digest hmacSha256(std::span<const std::uint8_t> key, std::string_view data) {
  return hmacSha256(key, std::as_bytes(std::span(data.data(), data.size())));
}

bool constantTimeEqual(std::span<const std::uint8_t> a, std::span<const std::uint8_t> b) {
  if (a.size() != b.size()) return false;
  if (a.empty()) return true;
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

std::vector<std::uint8_t> randomBytes(std::size_t n) {
  std::vector<std::uint8_t> out(n);
  if (n > 0) PD_CHECK_MSG(RAND_bytes(out.data(), static_cast<int>(n)) == 1, "the CSPRNG failed");
  return out;
}

std::string randomHex128() {
  return toHex(randomBytes(16));
}

std::string toHex(std::span<const std::uint8_t> bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (const std::uint8_t b : bytes) {
    out.push_back(kDigits[b >> 4]);
    out.push_back(kDigits[b & 0xF]);
  }
  return out;
}

namespace {
int hexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}
}  // namespace

Result<std::vector<std::uint8_t>> fromHex(std::string_view hex) {
  if (hex.size() % 2 != 0) return makeError(ErrorCode::InvalidArgument, "hex text has an odd number of digits");
  std::vector<std::uint8_t> out;
  out.reserve(hex.size() / 2);
  for (std::size_t i = 0; i < hex.size(); i += 2) {
    const int hi = hexValue(hex[i]);
    const int lo = hexValue(hex[i + 1]);
    if (hi < 0 || lo < 0) return makeError(ErrorCode::InvalidArgument, "hex text has a non-hex character");
    out.push_back(static_cast<std::uint8_t>((hi << 4) | lo));
  }
  return out;
}

}  // namespace pd::crypto
