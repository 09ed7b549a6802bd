#include "pd/common/dtype.h"

#include <array>
#include <bit>
#include <cmath>

#include "pd/common/check.h"

namespace pd {

namespace {

struct DTypeInfo {
  DType dtype;
  std::string_view name;
  std::size_t size;
};

constexpr std::array<DTypeInfo, 7> kDTypes = {{
    {DType::BF16, "BF16", 2},
    {DType::F16, "F16", 2},
    {DType::F32, "F32", 4},
    {DType::F8E4M3, "F8_E4M3", 1},
    {DType::I32, "I32", 4},
    {DType::I64, "I64", 8},
    {DType::U8, "U8", 1},
}};

const DTypeInfo& info(DType dtype) {
  for (const DTypeInfo& entry : kDTypes) {
    if (entry.dtype == dtype) return entry;
  }
  PD_CHECK_MSG(false, "DType value outside the enum");
  return kDTypes[0];
}

// Builds the float32 bit pattern of each e4m3fn code directly (rebias the exponent, widen the
// mantissa); the tests check it against an independent ldexp formula. Evaluated at compile time,
// so other static initializers can decode safely.
constexpr std::array<float, 256> buildFp8Table() {
  std::array<float, 256> table{};
  for (std::uint32_t code = 0; code < 256; ++code) {
    const std::uint32_t sign = (code & 0x80U) << 24;
    const std::uint32_t exponent = (code >> 3) & 0xFU;
    const std::uint32_t mantissa = code & 0x7U;
    std::uint32_t bits = 0;
    if (exponent == 0xF && mantissa == 0x7) {
      bits = sign | 0x7FC00000U;
    } else if (exponent != 0) {
      bits = sign | ((exponent + 127U - 7U) << 23) | (mantissa << 20);
    } else if (mantissa != 0) {
      // Subnormal: m/8 * 2^-6 = m * 2^-9, exact in float32.
      const float magnitude = static_cast<float>(mantissa) * 0x1p-9F;
      bits = sign | std::bit_cast<std::uint32_t>(magnitude);
    } else {
      bits = sign;
    }
    table[code] = std::bit_cast<float>(bits);
  }
  return table;
}

constexpr std::array<float, 256> kFp8Table = buildFp8Table();

}  // namespace

std::string_view dtypeName(DType dtype) {
  return info(dtype).name;
}

std::optional<DType> parseDType(std::string_view name) {
  for (const DTypeInfo& entry : kDTypes) {
    if (entry.name == name) return entry.dtype;
  }
  return std::nullopt;
}

std::size_t dtypeSize(DType dtype) {
  return info(dtype).size;
}

float bf16ToFloat(std::uint16_t bits) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
}

std::uint16_t floatToBf16(float value) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(value);
  if (std::isnan(value)) {
    // Truncating could clear every payload bit and turn the NaN into an infinity.
    return static_cast<std::uint16_t>((bits >> 16) | 0x0040U);
  }
  const std::uint32_t lsb = (bits >> 16) & 1U;
  return static_cast<std::uint16_t>((bits + 0x7FFFU + lsb) >> 16);
}

float f16ToFloat(std::uint16_t bits) {
  const std::uint32_t sign = (static_cast<std::uint32_t>(bits) & 0x8000U) << 16;
  const std::uint32_t exponent = (bits >> 10) & 0x1FU;
  const std::uint32_t mantissa = bits & 0x3FFU;
  std::uint32_t out = 0;
  if (exponent == 0x1F) {
    out = sign | 0x7F800000U | (mantissa << 13);
  } else if (exponent != 0) {
    out = sign | ((exponent + 127U - 15U) << 23) | (mantissa << 13);
  } else {
    // Zero or subnormal: m * 2^-24, exact in float32.
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24F;
    out = sign | std::bit_cast<std::uint32_t>(magnitude);
  }
  return std::bit_cast<float>(out);
}

float fp8e4m3ToFloat(std::uint8_t bits) {
  return kFp8Table[bits];
}

const float* fp8e4m3Table() {
  return kFp8Table.data();
}

std::uint8_t floatToFp8e4m3(float value) {
  if (std::isnan(value)) return 0x7F;
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(value);
  const auto sign = static_cast<std::uint8_t>((bits >> 24) & 0x80U);
  const float magnitude = std::fabs(value);
  constexpr std::uint8_t kMaxFinite = 0x7E;  // 448
  if (magnitude >= 448.0F) return sign | kMaxFinite;
  if (magnitude < 0x1p-6F) {
    // Subnormal range: the code is the multiple of 2^-9 nearest to the value. Scaling by a power
    // of two and splitting off the fraction are exact, so the tie test is exact too.
    const float scaled = magnitude * 512.0F;
    auto whole = static_cast<std::uint32_t>(scaled);
    const float fraction = scaled - static_cast<float>(whole);
    if (fraction > 0.5F || (fraction == 0.5F && (whole & 1U) != 0)) ++whole;
    return static_cast<std::uint8_t>(sign | whole);  // whole == 8 is the smallest normal, 2^-6
  }
  // Normal range: round the float32 mantissa to 3 bits (ties to even); a carry moves into the
  // exponent, which is what rounding up to the next binade needs.
  const std::uint32_t abs_bits = bits & 0x7FFFFFFFU;
  const std::uint32_t lsb = (abs_bits >> 20) & 1U;
  const std::uint32_t rounded = (abs_bits + 0x7FFFFU + lsb) >> 20;
  const std::uint32_t code = rounded - ((127U - 7U) << 3);
  return static_cast<std::uint8_t>(sign | (code > kMaxFinite ? kMaxFinite : code));
}

}  // namespace pd
