// TransferId: CSPRNG draw and the validated text form (transfer_id.h).
#include "pd/kvtransfer/transfer_id.h"

#include <string>
#include <vector>

#include "pd/common/crypto.h"

namespace pd::kvtransfer {
namespace {

int lowerHexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;
}

std::uint64_t loadBigEndian(const std::uint8_t* p) {
  std::uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | p[i];
  return v;
}

}  // namespace

TransferId TransferId::random() {
  for (;;) {
    const std::vector<std::uint8_t> bytes = crypto::randomBytes(16);
    const TransferId id{loadBigEndian(bytes.data()), loadBigEndian(bytes.data() + 8)};
    if (id != TransferId{}) return id;  // probability 2^-128; zero stays free to mean "none"
  }
}

Result<TransferId> TransferId::fromHex(std::string_view hex) {
  if (hex.size() != kHexChars) {
    return makeError(ErrorCode::InvalidArgument, "a transfer id is " + std::to_string(kHexChars) + " hex digits, not " +
                                                     std::to_string(hex.size()));
  }
  TransferId id;
  for (std::size_t i = 0; i < kHexChars; ++i) {
    const int v = lowerHexValue(hex[i]);
    if (v < 0) return makeError(ErrorCode::InvalidArgument, "a transfer id holds only lowercase hex digits");
    std::uint64_t& half = i < kHexChars / 2 ? id.hi : id.lo;
    half = (half << 4) | static_cast<std::uint64_t>(v);
  }
  return id;
}

std::string TransferId::hex() const {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(kHexChars, '0');
  for (std::size_t i = 0; i < kHexChars / 2; ++i) {
    out[kHexChars / 2 - 1 - i] = kDigits[(hi >> (4 * i)) & 0xF];
    out[kHexChars - 1 - i] = kDigits[(lo >> (4 * i)) & 0xF];
  }
  return out;
}

}  // namespace pd::kvtransfer
