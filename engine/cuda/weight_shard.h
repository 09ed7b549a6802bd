#pragma once
/// One tensor-parallel rank's weights as named host tensors, for the device upload
/// (DeviceWeights::upload, device_weights.h): every tensor the CUDA engine binds, named as in the
/// checkpoint, with the rank's shapes. The slicing itself is ModelWeights::load(dir, TpShard)'s
/// (docs/tensor-parallel.md): heads, MLP widths and vocab rows of the rank, FP8 block scales
/// re-blocked where a slice does not start on a block boundary, so a tensor's FP8 blocks are
/// carried with it. Plain host code, compiled into every build and unit-tested everywhere.
///
/// Thread rules: pure function of an immutable ModelWeights; the tensors point into it (its
/// mapped checkpoint or its copied-out slices) and are valid while it lives.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "pd/common/dtype.h"
#include "pd/common/result.h"
#include "pd/engine/model_weights.h"

namespace pd::gpu {

struct HostTensor {
  std::string name;
  DType dtype = DType::F32;
  std::vector<std::int64_t> shape;
  std::span<const std::byte> data;
  /// An FP8 weight's scale blocks (its `<name>_scale_inv` tensor follows it in the list); 0 for
  /// every other tensor.
  std::int64_t block_rows = 0;
  std::int64_t block_cols = 0;
};

/// The weights `w` binds (its shard), as host tensors in a fixed order: the embedding, every
/// layer, the final norm, the LM head, the MTP layer (its own head and embedding only when the
/// checkpoint has them). Norms and router biases are F32. InvalidArgument for a matrix whose
/// dtype has no fixed element size.
[[nodiscard]] Result<std::vector<HostTensor>> shardTensors(const model::ModelWeights& w);

}  // namespace pd::gpu
