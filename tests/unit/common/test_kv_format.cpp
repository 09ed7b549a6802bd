// The KV cache's token formats (pd/common/kv_format.h): sizes, the FP8 tile layout, the error
// bound of the FP8 quantization, and exact round trips for F32 and BF16.

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "pd/common/kv_format.h"

namespace pd {
namespace {

TEST(KvFormat, TokenBytesPerDType) {
  EXPECT_EQ(kvTokenBytes(DType::F32, 576), 2304U);
  EXPECT_EQ(kvTokenBytes(DType::BF16, 576), 1152U);
  EXPECT_EQ(kvTokenBytes(DType::F8E4M3, 576), 576U + 9U * 4U);  // DeepSeek-V3: 612, 53 % of BF16
  EXPECT_EQ(kvFp8Tiles(576), 9);
  // Codes padded to 4 bytes so the scales are aligned; the last tile is short.
  EXPECT_EQ(kvFp8ScaleOffset(37), 40U);
  EXPECT_EQ(kvTokenBytes(DType::F8E4M3, 37), 40U + 4U);
  EXPECT_EQ(kvTokenBytes(DType::F8E4M3, 65), 68U + 8U);
  EXPECT_EQ(kvTokenBytes(DType::F8E4M3, 0), 0U);
  EXPECT_EQ(kvTokenBytes(DType::I32, 8), 0U);
  EXPECT_FALSE(isKvDType(DType::F16));
  EXPECT_EQ(parseKvDType("fp8"), DType::F8E4M3);
  EXPECT_EQ(parseKvDType("bf16"), DType::BF16);
  EXPECT_EQ(parseKvDType("f32"), DType::F32);
  EXPECT_FALSE(parseKvDType("fp16").has_value());
  EXPECT_EQ(kvDTypeName(DType::F8E4M3), "fp8");
}

std::vector<float> randomLatent(std::int64_t d, std::uint32_t seed, float spread) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  std::vector<float> v(static_cast<std::size_t>(d));
  for (auto& x : v) x = normal(rng) * std::pow(spread, normal(rng));
  return v;
}

TEST(KvFormat, Fp8TilesKeepEachValueWithinHalfAStepOfItsTileScale) {
  for (const std::int64_t d : {1, 37, 64, 65, 576}) {
    for (std::uint32_t seed = 0; seed < 20; ++seed) {
      const std::vector<float> x = randomLatent(d, seed, seed % 2 == 0 ? 1.0F : 10.0F);
      std::vector<std::byte> token(kvTokenBytes(DType::F8E4M3, d), std::byte{0xAB});
      encodeKvToken(DType::F8E4M3, x, token.data());
      std::vector<float> y(static_cast<std::size_t>(d));
      decodeKvToken(DType::F8E4M3, token.data(), y);
      for (std::int64_t t = 0; t < kvFp8Tiles(d); ++t) {
        float amax = 0.0F;
        for (std::int64_t i = t * kKvFp8Tile; i < std::min(d, (t + 1) * kKvFp8Tile); ++i) {
          amax = std::max(amax, std::fabs(x[static_cast<std::size_t>(i)]));
        }
        float scale = 0.0F;
        std::memcpy(&scale, token.data() + kvFp8ScaleOffset(d) + t * 4, 4);
        EXPECT_EQ(scale, amax / 448.0F) << "d " << d << " tile " << t;
        for (std::int64_t i = t * kKvFp8Tile; i < std::min(d, (t + 1) * kKvFp8Tile); ++i) {
          const float xi = x[static_cast<std::size_t>(i)];
          const float yi = y[static_cast<std::size_t>(i)];
          // e4m3: 3 mantissa bits, so a relative step of 2^-3 (error <= 2^-4) for normal codes, and an
          // absolute step of 2^-9 x scale below 2^-6 x scale; plus float rounding.
          const float bound = std::max(std::fabs(xi) * 0x1p-4F, scale * 0x1p-10F) * 1.0001F + 1e-30F;
          EXPECT_LE(std::fabs(xi - yi), bound) << "d " << d << " i " << i << " x " << xi;
        }
        // The tile's largest magnitude maps to the largest code.
        for (std::int64_t i = t * kKvFp8Tile; i < std::min(d, (t + 1) * kKvFp8Tile); ++i) {
          if (std::fabs(x[static_cast<std::size_t>(i)]) == amax && amax > 0) {
            EXPECT_EQ(static_cast<unsigned>(token[static_cast<std::size_t>(i)]) & 0x7FU, 0x7EU);
          }
        }
      }
      for (std::uint64_t pad = static_cast<std::uint64_t>(d); pad < kvFp8ScaleOffset(d); ++pad) {
        EXPECT_EQ(token[pad], std::byte{0}) << "padding byte " << pad;
      }
    }
  }
}

TEST(KvFormat, Fp8TilesAreScaledOnTheirOwn) {
  // A huge value in tile 0 costs tile 1 nothing: the small values there keep their precision.
  std::vector<float> x(128, 0.001F);
  x[3] = 1000.0F;
  x[70] = 0.002F;
  std::vector<std::byte> token(kvTokenBytes(DType::F8E4M3, 128));
  encodeKvToken(DType::F8E4M3, x, token.data());
  std::vector<float> y(128);
  decodeKvToken(DType::F8E4M3, token.data(), y);
  EXPECT_FLOAT_EQ(y[3], 1000.0F);
  EXPECT_FLOAT_EQ(y[70], 0.002F);
  EXPECT_NEAR(y[100], 0.001F, 0.001F / 16);
  EXPECT_EQ(y[10], 0.0F);  // 0.001 against 1000 in tile 0: below e4m3's smallest step there
}

TEST(KvFormat, Fp8ZeroTileHasScaleZeroAndDecodesToZero) {
  std::vector<float> x(70, 0.0F);
  x[69] = -2.5F;
  std::vector<std::byte> token(kvTokenBytes(DType::F8E4M3, 70), std::byte{0xFF});
  encodeKvToken(DType::F8E4M3, x, token.data());
  float scale0 = 1.0F;
  std::memcpy(&scale0, token.data() + kvFp8ScaleOffset(70), 4);
  EXPECT_EQ(scale0, 0.0F);
  std::vector<float> y(70, 7.0F);
  decodeKvToken(DType::F8E4M3, token.data(), y);
  for (int i = 0; i < 69; ++i) EXPECT_EQ(y[static_cast<std::size_t>(i)], 0.0F);
  EXPECT_FLOAT_EQ(y[69], -2.5F);  // a tile's max: 448 x (max / 448)
}

TEST(KvFormat, F32AndBf16RoundTripAsBefore) {
  const std::vector<float> x = randomLatent(75, 3, 4.0F);
  std::vector<std::byte> f32(kvTokenBytes(DType::F32, 75));
  std::vector<std::byte> bf16(kvTokenBytes(DType::BF16, 75));
  encodeKvToken(DType::F32, x, f32.data());
  encodeKvToken(DType::BF16, x, bf16.data());
  std::vector<float> a(75), b(75);
  decodeKvToken(DType::F32, f32.data(), a);
  decodeKvToken(DType::BF16, bf16.data(), b);
  EXPECT_EQ(a, x);
  for (std::size_t i = 0; i < x.size(); ++i) EXPECT_EQ(b[i], bf16ToFloat(floatToBf16(x[i])));
}

}  // namespace
}  // namespace pd
