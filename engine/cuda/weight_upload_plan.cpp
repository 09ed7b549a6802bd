// Host arithmetic of the weight upload (weight_upload_plan.h), in every build.
#include "weight_upload_plan.h"

#include <algorithm>
#include <limits>

namespace pd::gpu {

Result<DeviceTensorLayout> layoutDeviceTensors(std::span<const std::uint64_t> tensor_bytes) {
  constexpr std::uint64_t kMax = std::numeric_limits<std::uint64_t>::max() - kDeviceTensorAlignment;
  DeviceTensorLayout layout;
  layout.offsets.reserve(tensor_bytes.size());
  std::uint64_t end = 0;
  for (const std::uint64_t bytes : tensor_bytes) {
    layout.offsets.push_back(end);
    if (bytes > kMax - end) return makeError(ErrorCode::InvalidArgument, "layoutDeviceTensors: sizes overflow 64 bits");
    end += bytes;
    end = (end + kDeviceTensorAlignment - 1) / kDeviceTensorAlignment * kDeviceTensorAlignment;
  }
  layout.total = end;
  return layout;
}

Result<std::vector<UploadChunk>> planUploadChunks(std::span<const std::uint64_t> tensor_bytes,
                                                  std::uint64_t chunk_bytes) {
  if (chunk_bytes == 0) return makeError(ErrorCode::InvalidArgument, "planUploadChunks: chunk_bytes is 0");
  std::vector<UploadChunk> chunks;
  UploadChunk current;
  for (std::size_t t = 0; t < tensor_bytes.size(); ++t) {
    std::uint64_t done = 0;
    while (done < tensor_bytes[t]) {
      const std::uint64_t take = std::min(tensor_bytes[t] - done, chunk_bytes - current.bytes);
      current.pieces.push_back(UploadPiece{t, done, take, current.bytes});
      current.bytes += take;
      done += take;
      if (current.bytes == chunk_bytes) {
        chunks.push_back(std::move(current));
        current = UploadChunk{};
      }
    }
  }
  if (current.bytes > 0) chunks.push_back(std::move(current));
  return chunks;
}

}  // namespace pd::gpu
