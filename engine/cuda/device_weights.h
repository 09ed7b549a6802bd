#pragma once
/// A checkpoint's tensors resident on one CUDA device, in their stored dtype: BF16 stays BF16,
/// FP8 e4m3 stays FP8 beside its F32 128x128 block scales (the `*_scale_inv` tensors), nothing is
/// converted. Loaded through a pinned staging buffer in chunks (weight_upload_plan.h), two halves
/// alternating so the host fills one while the device copies the other, with progress in the log.
/// Before the first device allocation the fit check (device_memory_plan.h) compares weights + KV
/// pool + workspace with cudaMemGetInfo's free bytes and fails with an error naming each part.
///
/// Private to the CUDA backend (engine/cuda) and its tests.
/// Thread rules: upload() runs on the caller's thread; a DeviceWeights is immutable after it and
/// its const methods are thread-safe. It makes its device current when it is destroyed.

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "device_memory_plan.h"
#include "pd/common/dtype.h"
#include "pd/common/result.h"
#include "pd/cuda/cuda_handles.h"
#include "pd/engine/gpu.h"
#include "pd/engine/model_config.h"
#include "pd/engine/safetensors.h"
#include "weight_shard.h"
#include "weight_upload_plan.h"

namespace pd::gpu {

class DeviceWeights {
 public:
  struct Options {
    ModelDevice device{ModelDevice::Kind::Cuda, 0};
    DeviceServingShape serving;  ///< what else must fit beside the weights (KV pool, workspace)
    std::uint64_t staging_bytes = std::uint64_t{256} << 20;  ///< pinned staging, both halves together
    std::uint64_t reserve_bytes = std::uint64_t{512} << 20;  ///< kept free for the runtime and cuBLAS
  };

  /// One tensor in device memory.
  struct Tensor {
    std::string name;
    DType dtype = DType::F32;
    std::vector<std::int64_t> shape;
    const void* data = nullptr;  ///< device pointer, aligned to kDeviceTensorAlignment
    std::uint64_t bytes = 0;
    /// An FP8 weight's scale blocks when a tensor-parallel slice re-blocked them (HostTensor);
    /// 0: the checkpoint's (the config's quantization blocks).
    std::int64_t block_rows = 0;
    std::int64_t block_cols = 0;
  };

  /// Uploads every tensor of `checkpoint` (sorted by name). Unsupported "no CUDA device" when
  /// none is visible; InvalidArgument for a bad device index or options; ResourceExhausted
  /// naming weights, KV pool and workspace bytes when they do not fit (nothing allocated then);
  /// the CUDA error otherwise.
  [[nodiscard]] static Result<DeviceWeights> upload(const Checkpoint& checkpoint, const ModelConfig& config,
                                                    const Options& options);
  /// The same for host tensors (weight_shard.h: one tensor-parallel rank's shard), in their
  /// order; the fit check counts exactly their bytes.
  [[nodiscard]] static Result<DeviceWeights> upload(const std::vector<HostTensor>& tensors, const ModelConfig& config,
                                                    const Options& options);

  [[nodiscard]] const std::vector<Tensor>& tensors() const { return tensors_; }
  /// nullptr when absent.
  [[nodiscard]] const Tensor* find(std::string_view name) const;
  /// Bytes of the device allocation (tensors plus alignment padding).
  [[nodiscard]] std::uint64_t deviceBytes() const { return arena_.bytes(); }
  /// The plan the fit check accepted.
  [[nodiscard]] const DeviceMemoryPlan& plan() const { return plan_; }
  [[nodiscard]] const ModelDevice& device() const { return device_; }

  /// Copies one tensor back to the host (synchronously): for tests and checks.
  [[nodiscard]] Result<std::vector<std::byte>> readBack(const Tensor& tensor) const;

  DeviceWeights(const DeviceWeights&) = delete;
  DeviceWeights& operator=(const DeviceWeights&) = delete;
  DeviceWeights(DeviceWeights&&) noexcept = default;
  DeviceWeights& operator=(DeviceWeights&&) noexcept = default;
  ~DeviceWeights();

 private:
  DeviceWeights(ModelDevice device, DeviceMemoryPlan plan, cuda::DeviceBuffer<std::byte> arena,
                std::vector<Tensor> tensors);
  ModelDevice device_;
  DeviceMemoryPlan plan_;
  cuda::DeviceBuffer<std::byte> arena_;
  std::vector<Tensor> tensors_;
  std::unordered_map<std::string, std::size_t> by_name_;
};

}  // namespace pd::gpu
