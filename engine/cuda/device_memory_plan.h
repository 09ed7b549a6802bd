#pragma once
/// What a device-resident engine needs in device memory, computed on the host before anything
/// is allocated: the weights (every tensor of the checkpoint layout, FP8 kept FP8 with its
/// scales), the latent KV pool, and the per-step workspaces. checkDeviceFit() turns a plan that
/// does not fit into one clear error naming each part's bytes. Plain arithmetic, no CUDA: it is
/// compiled into every build and unit-tested everywhere (tests/unit/engine_cuda).
///
/// Thread rules: pure functions.

#include <cstdint>
#include <string>

#include "pd/common/dtype.h"
#include "pd/common/result.h"
#include "pd/engine/model_config.h"

namespace pd::gpu {

/// The shape of what the engine will serve, beside the model itself.
struct DeviceServingShape {
  std::int64_t kv_blocks = 0;         ///< latent KV pool blocks (per KV layer)
  std::int64_t kv_block_size = 64;    ///< tokens per block
  DType kv_dtype = DType::BF16;       ///< F32 or BF16
  std::int64_t max_batch_tokens = 0;  ///< most tokens in one forward (prefill chunk or decode batch x (1 + drafts))
  std::int64_t max_context = 0;       ///< longest sequence attended
  std::int64_t max_sample_rows = 0;   ///< most rows sampled in one step
};

struct DeviceMemoryPlan {
  std::uint64_t weights = 0;    ///< every checkpoint tensor (expectedTensors(config)) in its stored dtype
  std::uint64_t kv_pool = 0;    ///< kv layers x blocks x block size x latent dim x dtype size
  std::uint64_t workspace = 0;  ///< activations, attention splits, sampling (an upper bound)
  [[nodiscard]] std::uint64_t total() const { return weights + kv_pool + workspace; }
};

/// Bytes of every tensor of `config`'s checkpoint layout as make-model writes it (FP8 weights one
/// byte each plus their F32 block scales when config.quantization is set, BF16 otherwise; norms
/// and biases as specified). Equals Checkpoint::totalTensorBytes() for such a checkpoint.
[[nodiscard]] std::uint64_t checkpointLayoutBytes(const ModelConfig& config);

/// The plan for serving `config` with `shape`. InvalidArgument for a non-positive size or a KV
/// dtype other than F32/BF16.
[[nodiscard]] Result<DeviceMemoryPlan> planDeviceMemory(const ModelConfig& config, const DeviceServingShape& shape);

/// OK when the plan fits in `free_bytes` (what cudaMemGetInfo reports free) with `reserve_bytes`
/// kept back; otherwise ResourceExhausted naming the device and each part, e.g.
/// "cuda:0: the model does not fit: weights 688.6 GB + KV pool 9.6 GB + workspace 1.3 GB =
/// 699.5 GB, but 139.8 GB are free (0.5 GB kept in reserve)".
[[nodiscard]] Status checkDeviceFit(const DeviceMemoryPlan& plan, std::uint64_t free_bytes, std::uint64_t reserve_bytes,
                                    const std::string& device_name);

}  // namespace pd::gpu
