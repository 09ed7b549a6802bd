#pragma once
/// How checkpoint tensors travel to the device (DeviceWeights, device_weights.h), decided on the
/// host before anything is allocated: where each tensor lives in the one device allocation (the
/// arena: offsets aligned to kDeviceTensorAlignment), and how the bytes are cut into chunks that
/// each fit the pinned staging buffer (a tensor larger than a chunk spans several; small tensors
/// share one). Plain arithmetic, no CUDA: compiled into every build and unit-tested everywhere.
///
/// Thread rules: pure functions.

#include <cstdint>
#include <span>
#include <vector>

#include "pd/common/result.h"

namespace pd::gpu {

/// Alignment of every tensor in the device arena (cudaMalloc's own alignment; enough for any
/// vectorized load).
inline constexpr std::uint64_t kDeviceTensorAlignment = 256;

struct DeviceTensorLayout {
  std::vector<std::uint64_t> offsets;  ///< per tensor, multiples of kDeviceTensorAlignment, ascending
  std::uint64_t total = 0;             ///< arena bytes (the end of the last tensor, aligned)
};

/// Lays the tensors out back to back in input order. InvalidArgument on 64-bit overflow.
[[nodiscard]] Result<DeviceTensorLayout> layoutDeviceTensors(std::span<const std::uint64_t> tensor_bytes);

/// One copy from a tensor's bytes into the staging buffer, then on to the device.
struct UploadPiece {
  std::size_t tensor = 0;            ///< index into the tensor list
  std::uint64_t source_offset = 0;   ///< into the tensor's bytes (and its device bytes)
  std::uint64_t bytes = 0;           ///< > 0
  std::uint64_t staging_offset = 0;  ///< into the staging buffer
};
/// What fills the staging buffer once: pieces back to back from staging offset 0.
struct UploadChunk {
  std::vector<UploadPiece> pieces;
  std::uint64_t bytes = 0;  ///< sum of the pieces' bytes, in (0, chunk_bytes]
};

/// Cuts the tensors, in order, into chunks of at most `chunk_bytes`: every byte of every tensor
/// in exactly one piece, each piece inside one chunk, every chunk full except the last. Empty
/// tensors get no piece. InvalidArgument when chunk_bytes is 0.
[[nodiscard]] Result<std::vector<UploadChunk>> planUploadChunks(std::span<const std::uint64_t> tensor_bytes,
                                                                std::uint64_t chunk_bytes);

}  // namespace pd::gpu
