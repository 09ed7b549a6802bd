#pragma once
/// How one token's MLA latent (kv_lora_rank + qk_rope_head_dim values) is stored in a paged KV
/// cache, a decode worker's pool and on the KV wire (docs/kv-memory.md, "KV dtypes"):
///
///  - F32: latent_dim float32 values; BF16: latent_dim bfloat16 values (round to nearest even).
///  - F8E4M3 ("fp8"): the latent cut into tiles of kKvFp8Tile values (the last one shorter when
///    latent_dim is not a multiple), each tile quantized to e4m3fn with one float32 scale:
///    scale = max|x| / 448 over the tile, code = e4m3(x / scale) (round to nearest even,
///    saturating), value = e4m3(code) * scale. A tile of zeros has scale 0. The token is
///    [codes: latent_dim bytes, padded with zeros to a multiple of 4][scales: one float32 per
///    tile], so the scales are 4-byte aligned. DeepSeek-V3's 576-value latent takes 576 + 9 x 4 =
///    612 bytes (BF16: 1152); its tile 8 is exactly the 64 RoPE values, scaled on their own.
///
/// The CUDA kernels compute the same bytes with the arithmetic of engine/cuda/device_math.h
/// (a unit test holds the two equal).
///
/// Thread rules: pure functions.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>

#include "pd/common/dtype.h"

namespace pd {

inline constexpr std::int64_t kKvFp8Tile = 64;
/// The largest finite e4m3fn value: a tile's max|x| maps to it.
inline constexpr float kFp8E4M3Max = 448.0F;

/// F32, BF16 or F8E4M3.
[[nodiscard]] bool isKvDType(DType dtype);
/// Bytes of one token's latent in `dtype` (0 for a dtype that is not a KV dtype, or latent_dim <= 0).
[[nodiscard]] std::uint64_t kvTokenBytes(DType dtype, std::int64_t latent_dim);
/// Tiles of an F8E4M3 token, and where their scales start inside it.
[[nodiscard]] std::int64_t kvFp8Tiles(std::int64_t latent_dim);
[[nodiscard]] std::uint64_t kvFp8ScaleOffset(std::int64_t latent_dim);

/// "f32" | "bf16" | "fp8" (also "fp8_e4m3"): the configuration spelling of a KV dtype.
[[nodiscard]] std::optional<DType> parseKvDType(std::string_view text);
/// "f32", "bf16", "fp8".
[[nodiscard]] std::string_view kvDTypeName(DType dtype);

/// Encodes `values` (latent_dim of them) as one token of `dtype` into `token`
/// (kvTokenBytes(dtype, latent_dim) bytes).
void encodeKvToken(DType dtype, std::span<const float> values, std::byte* token);
/// Decodes one token of `dtype` into `out` (latent_dim values).
void decodeKvToken(DType dtype, const std::byte* token, std::span<float> out);

}  // namespace pd
