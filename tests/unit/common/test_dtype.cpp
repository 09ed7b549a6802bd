// Bit-exact checks of the scalar conversions against independent formulas: every fp8, bf16 and f16
// code, the rounding of sampled and hand-picked floats, and round trips.

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "pd/common/dtype.h"

namespace pd {
namespace {

std::uint32_t bitsOf(float v) {
  return std::bit_cast<std::uint32_t>(v);
}
float floatOf(std::uint32_t bits) {
  return std::bit_cast<float>(bits);
}

// e4m3fn from its definition: (-1)^s * 2^(e-7) * (1 + m/8), or (-1)^s * 2^-6 * (m/8) for e == 0.
double fp8Reference(unsigned code) {
  const double sign = (code & 0x80U) != 0 ? -1.0 : 1.0;
  const unsigned e = (code >> 3) & 0xFU;
  const unsigned m = code & 0x7U;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  if (e == 0) return sign * std::ldexp(static_cast<double>(m) / 8.0, -6);
  return sign * std::ldexp(1.0 + static_cast<double>(m) / 8.0, static_cast<int>(e) - 7);
}

// Nearest e4m3fn code by search over the reference values; ties to the even code, saturating.
std::uint8_t fp8EncodeReference(float x) {
  if (std::isnan(x)) return 0x7F;
  const std::uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const double a = std::fabs(static_cast<double>(x));
  if (a >= 448.0) return sign | 0x7E;
  static const std::vector<double> positives = [] {
    std::vector<double> v;
    for (unsigned c = 0; c <= 0x7E; ++c) v.push_back(fp8Reference(c));
    return v;
  }();
  const auto hi = static_cast<unsigned>(std::lower_bound(positives.begin(), positives.end(), a) - positives.begin());
  if (positives[hi] == a) return static_cast<std::uint8_t>(sign | hi);
  const unsigned lo = hi - 1;
  const double dlo = a - positives[lo];
  const double dhi = positives[hi] - a;
  unsigned pick = dlo < dhi ? lo : (dhi < dlo ? hi : ((lo & 1U) == 0 ? lo : hi));
  return static_cast<std::uint8_t>(sign | pick);
}

// bf16 nearest by comparing the two candidates around x; ties to even, overflow to infinity.
std::uint16_t bf16EncodeReference(float x) {
  const std::uint32_t bits = bitsOf(x);
  if (std::isinf(x)) return static_cast<std::uint16_t>(bits >> 16);
  const auto lo = static_cast<std::uint16_t>(bits >> 16);  // truncation: same sign, |lo| <= |x|
  const auto hi = static_cast<std::uint16_t>(lo + 1);      // next away from zero
  const double a = std::fabs(static_cast<double>(x));
  const double vlo = std::fabs(static_cast<double>(floatOf(static_cast<std::uint32_t>(lo) << 16)));
  const bool hi_is_inf = (hi & 0x7FFFU) == 0x7F80U;
  // Overflow rounds to infinity as if the exponent range were unbounded (IEEE 754 7.4).
  const double vhi =
      hi_is_inf ? std::ldexp(1.0, 128) : std::fabs(static_cast<double>(floatOf(static_cast<std::uint32_t>(hi) << 16)));
  const double dlo = a - vlo;
  const double dhi = vhi - a;
  if (dlo < dhi) return lo;
  if (dhi < dlo) return hi;
  return (lo & 1U) == 0 ? lo : hi;
}

TEST(Dtype, NamesSizesAndParsing) {
  const std::array<DType, 7> all = {DType::BF16, DType::F16, DType::F32, DType::F8E4M3,
                                    DType::I32,  DType::I64, DType::U8};
  const std::array<std::size_t, 7> sizes = {2, 2, 4, 1, 4, 8, 1};
  for (std::size_t i = 0; i < all.size(); ++i) {
    EXPECT_EQ(parseDType(dtypeName(all[i])), all[i]);
    EXPECT_EQ(dtypeSize(all[i]), sizes[i]);
  }
  EXPECT_EQ(dtypeName(DType::F8E4M3), "F8_E4M3");
  EXPECT_EQ(dtypeName(DType::BF16), "BF16");
  EXPECT_FALSE(parseDType("bf16"));
  EXPECT_FALSE(parseDType("F8_E5M2"));
  EXPECT_FALSE(parseDType(""));
}

TEST(Dtype, Fp8DecodeEveryCodeMatchesFormula) {
  const float* table = fp8e4m3Table();
  for (unsigned code = 0; code < 256; ++code) {
    SCOPED_TRACE(code);
    const auto c = static_cast<std::uint8_t>(code);
    const float got = fp8e4m3ToFloat(c);
    EXPECT_EQ(bitsOf(table[code]), bitsOf(got));
    const double want = fp8Reference(code);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got));
      continue;
    }
    EXPECT_EQ(static_cast<double>(got), want);
    EXPECT_EQ(std::signbit(got), (code & 0x80U) != 0);  // includes -0 for 0x80
  }
  EXPECT_TRUE(std::isnan(fp8e4m3ToFloat(0x7F)));
  EXPECT_TRUE(std::isnan(fp8e4m3ToFloat(0xFF)));
  EXPECT_EQ(fp8e4m3ToFloat(0x7E), 448.0F);
  EXPECT_EQ(fp8e4m3ToFloat(0xFE), -448.0F);
  EXPECT_EQ(fp8e4m3ToFloat(0x38), 1.0F);
  EXPECT_EQ(fp8e4m3ToFloat(0x01), 0x1p-9F);
  EXPECT_EQ(fp8e4m3ToFloat(0x07), 7 * 0x1p-9F);
  EXPECT_EQ(fp8e4m3ToFloat(0x08), 0x1p-6F);
}

TEST(Dtype, Fp8EncodeRoundTripsEveryCode) {
  for (unsigned code = 0; code < 256; ++code) {
    if ((code & 0x7FU) == 0x7F) continue;
    const auto c = static_cast<std::uint8_t>(code);
    EXPECT_EQ(floatToFp8e4m3(fp8e4m3ToFloat(c)), c) << code;
  }
}

TEST(Dtype, Fp8EncodeSpecialValues) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(floatToFp8e4m3(std::numeric_limits<float>::quiet_NaN()), 0x7F);
  EXPECT_EQ(floatToFp8e4m3(-std::numeric_limits<float>::quiet_NaN()), 0x7F);
  EXPECT_EQ(floatToFp8e4m3(inf), 0x7E);
  EXPECT_EQ(floatToFp8e4m3(-inf), 0xFE);
  EXPECT_EQ(floatToFp8e4m3(464.0F), 0x7E);  // halfway to the (NaN) 480: saturates
  EXPECT_EQ(floatToFp8e4m3(1e30F), 0x7E);
  EXPECT_EQ(floatToFp8e4m3(-1e30F), 0xFE);
  EXPECT_EQ(floatToFp8e4m3(0.0F), 0x00);
  EXPECT_EQ(floatToFp8e4m3(-0.0F), 0x80);
  EXPECT_EQ(floatToFp8e4m3(1e-30F), 0x00);
  EXPECT_EQ(floatToFp8e4m3(-1e-30F), 0x80);
  EXPECT_EQ(floatToFp8e4m3(0x1p-10F), 0x00);       // tie between 0 and 2^-9: even
  EXPECT_EQ(floatToFp8e4m3(3 * 0x1p-10F), 0x02);   // tie between 1 and 2 (x 2^-9): even
  EXPECT_EQ(floatToFp8e4m3(15 * 0x1p-10F), 0x08);  // tie between 7 x 2^-9 and 2^-6: even (0x08)
  EXPECT_EQ(floatToFp8e4m3(1.0625F), 0x38);        // tie between 1 and 1.125: even
  EXPECT_EQ(floatToFp8e4m3(1.1875F), 0x3A);        // tie between 1.125 and 1.25: even
  EXPECT_EQ(floatToFp8e4m3(std::nextafter(1.0625F, 2.0F)), 0x39);
  EXPECT_EQ(floatToFp8e4m3(15.5F), 0x58);  // tie between 15 (0x57) and 16 (0x58): even, next binade
}

TEST(Dtype, Fp8EncodeMatchesNearestSearch) {
  // Every midpoint between neighbouring codes and its float neighbours, both signs.
  for (unsigned code = 0; code < 0x7E; ++code) {
    const double mid = (fp8Reference(code) + fp8Reference(code + 1)) / 2.0;
    const auto m = static_cast<float>(mid);
    ASSERT_EQ(static_cast<double>(m), mid);
    for (const float x : {m, std::nextafter(m, 0.0F), std::nextafter(m, 1000.0F)}) {
      EXPECT_EQ(floatToFp8e4m3(x), fp8EncodeReference(x)) << x;
      EXPECT_EQ(floatToFp8e4m3(-x), fp8EncodeReference(-x)) << -x;
    }
  }
  // A stride through every float bit pattern (all exponents, both signs, NaNs and infinities).
  std::uint64_t checked = 0;
  for (std::uint64_t bits = 0; bits <= 0xFFFFFFFFULL; bits += 4099) {
    const float x = floatOf(static_cast<std::uint32_t>(bits));
    ASSERT_EQ(floatToFp8e4m3(x), fp8EncodeReference(x)) << std::hex << bits;
    ++checked;
  }
  EXPECT_GT(checked, 1000000U);
}

TEST(Dtype, Bf16DecodeEveryCode) {
  for (std::uint32_t code = 0; code < 0x10000; ++code) {
    const auto c = static_cast<std::uint16_t>(code);
    const float got = bf16ToFloat(c);
    const std::uint32_t e = (code >> 7) & 0xFFU;
    const std::uint32_t m = code & 0x7FU;
    const double sign = (code & 0x8000U) != 0 ? -1.0 : 1.0;
    if (e == 0xFF) {
      EXPECT_EQ(std::isnan(got), m != 0) << code;
      EXPECT_EQ(std::isinf(got), m == 0) << code;
      continue;
    }
    const double want = e == 0 ? sign * std::ldexp(static_cast<double>(m), -133)
                               : sign * std::ldexp(1.0 + static_cast<double>(m) / 128.0, static_cast<int>(e) - 127);
    ASSERT_EQ(static_cast<double>(got), want) << code;
    ASSERT_EQ(std::signbit(got), sign < 0) << code;
  }
}

TEST(Dtype, Bf16EncodeRoundTripsEveryCode) {
  for (std::uint32_t code = 0; code < 0x10000; ++code) {
    const auto c = static_cast<std::uint16_t>(code);
    const float f = bf16ToFloat(c);
    if (std::isnan(f)) {
      const std::uint16_t back = floatToBf16(f);
      EXPECT_TRUE(std::isnan(bf16ToFloat(back))) << code;
      EXPECT_EQ(back, c | 0x0040) << code;  // sign and payload kept, quiet bit set
      continue;
    }
    ASSERT_EQ(floatToBf16(f), c) << code;
  }
}

TEST(Dtype, Bf16EncodeRoundsToNearestEven) {
  EXPECT_EQ(floatToBf16(1.0F), 0x3F80);
  EXPECT_EQ(floatToBf16(1.0F + 0x1p-8F), 0x3F80);      // tie between 0x3F80 and 0x3F81: even
  EXPECT_EQ(floatToBf16(1.0F + 3 * 0x1p-8F), 0x3F82);  // tie between 0x3F81 and 0x3F82: even
  EXPECT_EQ(floatToBf16(std::nextafter(1.0F + 0x1p-8F, 2.0F)), 0x3F81);
  EXPECT_EQ(floatToBf16(std::nextafter(1.0F + 3 * 0x1p-8F, 0.0F)), 0x3F81);
  EXPECT_EQ(floatToBf16(-(1.0F + 0x1p-8F)), 0xBF80);
  EXPECT_EQ(floatToBf16(floatOf(0x3FFF8000U)), 0x4000);               // tie that carries into the exponent
  EXPECT_EQ(floatToBf16(std::numeric_limits<float>::max()), 0x7F80);  // overflows to +inf
  EXPECT_EQ(floatToBf16(-std::numeric_limits<float>::max()), 0xFF80);
  EXPECT_EQ(floatToBf16(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_EQ(floatToBf16(-std::numeric_limits<float>::infinity()), 0xFF80);
  EXPECT_EQ(floatToBf16(-0.0F), 0x8000);
  // Subnormals.
  EXPECT_EQ(floatToBf16(floatOf(0x00000001U)), 0x0000);
  EXPECT_EQ(floatToBf16(floatOf(0x00008000U)), 0x0000);  // tie: even
  EXPECT_EQ(floatToBf16(floatOf(0x00018000U)), 0x0002);  // tie: even
  EXPECT_EQ(floatToBf16(floatOf(0x00008001U)), 0x0001);
  EXPECT_EQ(floatToBf16(floatOf(0x007FFFFFU)), 0x0080);  // largest subnormal rounds to min normal
  // NaN stays NaN, including a signalling NaN whose payload lies only in the low 16 bits.
  EXPECT_EQ(floatToBf16(floatOf(0x7FC00000U)), 0x7FC0);
  const std::uint16_t snan = floatToBf16(floatOf(0x7F800001U));
  EXPECT_TRUE(std::isnan(bf16ToFloat(snan)));
  const std::uint16_t negative_nan = floatToBf16(floatOf(0xFFC00001U));
  EXPECT_TRUE(std::isnan(bf16ToFloat(negative_nan)));
  EXPECT_NE(negative_nan & 0x8000, 0);
}

TEST(Dtype, Bf16EncodeMatchesReference) {
  // Every midpoint between neighbouring bf16 values and its float neighbours.
  for (std::uint32_t code = 0; code < 0x7F80; ++code) {
    for (const std::uint32_t sign : {0U, 0x80000000U}) {
      const std::uint32_t mid = sign | (code << 16) | 0x8000U;
      for (const std::uint32_t bits : {mid - 1, mid, mid + 1}) {
        const float x = floatOf(bits);
        ASSERT_EQ(floatToBf16(x), bf16EncodeReference(x)) << std::hex << bits;
      }
    }
  }
  for (std::uint64_t bits = 0; bits <= 0xFFFFFFFFULL; bits += 4099) {
    const float x = floatOf(static_cast<std::uint32_t>(bits));
    if (std::isnan(x)) continue;
    ASSERT_EQ(floatToBf16(x), bf16EncodeReference(x)) << std::hex << bits;
  }
}

TEST(Dtype, F16DecodeEveryCode) {
  for (std::uint32_t code = 0; code < 0x10000; ++code) {
    const auto c = static_cast<std::uint16_t>(code);
    const float got = f16ToFloat(c);
    const std::uint32_t e = (code >> 10) & 0x1FU;
    const std::uint32_t m = code & 0x3FFU;
    const double sign = (code & 0x8000U) != 0 ? -1.0 : 1.0;
    ASSERT_EQ(std::signbit(got), sign < 0) << code;
    if (e == 0x1F) {
      ASSERT_EQ(std::isnan(got), m != 0) << code;
      ASSERT_EQ(std::isinf(got), m == 0) << code;
      continue;
    }
    const double want = e == 0 ? sign * std::ldexp(static_cast<double>(m), -24)
                               : sign * std::ldexp(1.0 + static_cast<double>(m) / 1024.0, static_cast<int>(e) - 15);
    ASSERT_EQ(static_cast<double>(got), want) << code;
  }
  EXPECT_EQ(f16ToFloat(0x3C00), 1.0F);
  EXPECT_EQ(f16ToFloat(0xC000), -2.0F);
  EXPECT_EQ(f16ToFloat(0x7BFF), 65504.0F);
  EXPECT_EQ(f16ToFloat(0x0001), 0x1p-24F);
  EXPECT_EQ(f16ToFloat(0x03FF), 1023 * 0x1p-24F);
  EXPECT_TRUE(std::isinf(f16ToFloat(0xFC00)));
}

}  // namespace
}  // namespace pd
