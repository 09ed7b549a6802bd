#pragma once
/// Element types of checkpoints and caches, and exact scalar conversions between them.
/// Thread rules: pure functions; the lookup table is a compile-time constant, safe to use from any
/// thread and from other static initializers.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace pd {

enum class DType { BF16, F16, F32, F8E4M3, I32, I64, U8 };

/// safetensors spelling: "BF16", "F16", "F32", "F8_E4M3", "I32", "I64", "U8".
[[nodiscard]] std::string_view dtypeName(DType dtype);
[[nodiscard]] std::optional<DType> parseDType(std::string_view name);
[[nodiscard]] std::size_t dtypeSize(DType dtype);

/// bfloat16 -> float32: exact (a shift).
[[nodiscard]] float bf16ToFloat(std::uint16_t bits);
/// float32 -> bfloat16, round to nearest even; NaN stays NaN (quiet bit set, sign and high payload
/// kept), infinities stay, finite values beyond the bf16 range round to infinity (IEEE).
[[nodiscard]] std::uint16_t floatToBf16(float value);

/// IEEE binary16 -> float32: exact, subnormals, infinities and NaN included.
[[nodiscard]] float f16ToFloat(std::uint16_t bits);

/// float8 e4m3fn -> float32: exact, via a 256-entry table. 0x7F / 0xFF are NaN.
[[nodiscard]] float fp8e4m3ToFloat(std::uint8_t bits);
/// The whole decode table, for kernels that dequantize in their inner loop.
[[nodiscard]] const float* fp8e4m3Table();
/// float32 -> e4m3fn, round to nearest even, saturating to +-448 (no infinities in e4m3fn);
/// NaN -> 0x7F. The sign survives rounding to zero: a tiny negative value gives 0x80 (-0).
[[nodiscard]] std::uint8_t floatToFp8e4m3(float value);

}  // namespace pd
