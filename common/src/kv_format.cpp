#include "pd/common/kv_format.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "pd/common/check.h"

namespace pd {

bool isKvDType(DType dtype) {
  return dtype == DType::F32 || dtype == DType::BF16 || dtype == DType::F8E4M3;
}

std::int64_t kvFp8Tiles(std::int64_t latent_dim) {
  return latent_dim <= 0 ? 0 : (latent_dim + kKvFp8Tile - 1) / kKvFp8Tile;
}

std::uint64_t kvFp8ScaleOffset(std::int64_t latent_dim) {
  return latent_dim <= 0 ? 0 : (static_cast<std::uint64_t>(latent_dim) + 3U) / 4U * 4U;
}

std::uint64_t kvTokenBytes(DType dtype, std::int64_t latent_dim) {
  if (latent_dim <= 0) return 0;
  const auto d = static_cast<std::uint64_t>(latent_dim);
  switch (dtype) {
    case DType::F32:
      return d * 4U;
    case DType::BF16:
      return d * 2U;
    case DType::F8E4M3:
      return kvFp8ScaleOffset(latent_dim) + static_cast<std::uint64_t>(kvFp8Tiles(latent_dim)) * sizeof(float);
    default:
      return 0;
  }
}

std::optional<DType> parseKvDType(std::string_view text) {
  if (text == "f32") return DType::F32;
  if (text == "bf16") return DType::BF16;
  if (text == "fp8" || text == "fp8_e4m3") return DType::F8E4M3;
  return std::nullopt;
}

std::string_view kvDTypeName(DType dtype) {
  switch (dtype) {
    case DType::F32:
      return "f32";
    case DType::BF16:
      return "bf16";
    case DType::F8E4M3:
      return "fp8";
    default:
      return "?";
  }
}

void encodeKvToken(DType dtype, std::span<const float> values, std::byte* token) {
  const auto d = static_cast<std::int64_t>(values.size());
  switch (dtype) {
    case DType::F32:
      std::memcpy(token, values.data(), values.size() * sizeof(float));
      return;
    case DType::BF16:
      for (std::int64_t i = 0; i < d; ++i) {
        const std::uint16_t h = floatToBf16(values[static_cast<std::size_t>(i)]);
        std::memcpy(token + i * 2, &h, 2);
      }
      return;
    case DType::F8E4M3: {
      const std::uint64_t scales_at = kvFp8ScaleOffset(d);
      std::memset(token + d, 0, scales_at - static_cast<std::uint64_t>(d));
      for (std::int64_t t = 0; t < kvFp8Tiles(d); ++t) {
        const std::int64_t first = t * kKvFp8Tile;
        const std::int64_t last = std::min(d, first + kKvFp8Tile);
        float amax = 0.0F;
        for (std::int64_t i = first; i < last; ++i) {
          const float a = std::fabs(values[static_cast<std::size_t>(i)]);
          if (a > amax) amax = a;
        }
        const float scale = amax / kFp8E4M3Max;
        for (std::int64_t i = first; i < last; ++i) {
          const std::uint8_t code = scale > 0.0F ? floatToFp8e4m3(values[static_cast<std::size_t>(i)] / scale) : 0;
          token[i] = static_cast<std::byte>(code);
        }
        std::memcpy(token + scales_at + static_cast<std::uint64_t>(t) * sizeof(float), &scale, sizeof(float));
      }
      return;
    }
    default:
      PD_CHECK_MSG(false, "not a KV dtype");
  }
}

void decodeKvToken(DType dtype, const std::byte* token, std::span<float> out) {
  const auto d = static_cast<std::int64_t>(out.size());
  switch (dtype) {
    case DType::F32:
      std::memcpy(out.data(), token, out.size() * sizeof(float));
      return;
    case DType::BF16:
      for (std::int64_t i = 0; i < d; ++i) {
        std::uint16_t h = 0;
        std::memcpy(&h, token + i * 2, 2);
        out[static_cast<std::size_t>(i)] = bf16ToFloat(h);
      }
      return;
    case DType::F8E4M3: {
      const std::uint64_t scales_at = kvFp8ScaleOffset(d);
      for (std::int64_t t = 0; t < kvFp8Tiles(d); ++t) {
        float scale = 0.0F;
        std::memcpy(&scale, token + scales_at + static_cast<std::uint64_t>(t) * sizeof(float), sizeof(float));
        const std::int64_t last = std::min(d, (t + 1) * kKvFp8Tile);
        for (std::int64_t i = t * kKvFp8Tile; i < last; ++i) {
          out[static_cast<std::size_t>(i)] = fp8e4m3ToFloat(static_cast<std::uint8_t>(token[i])) * scale;
        }
      }
      return;
    }
    default:
      PD_CHECK_MSG(false, "not a KV dtype");
  }
}

}  // namespace pd
