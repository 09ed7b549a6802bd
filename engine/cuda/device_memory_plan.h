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
#include <string_view>

#include "pd/common/dtype.h"
#include "pd/common/kv_format.h"
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

/// The latent KV cache's element type on the device: BF16 (the default), or FP8 e4m3 with one F32
/// scale per 64 values of a token (pd/common/kv_format.h, `decode.kv_dtype fp8`). F32: a decode
/// pool of `decode.kv_dtype f32` (the golden parity mode).
enum class KvCacheDtype { Bf16, Fp8E4m3, F32 };

/// "bf16" or "fp8" (the option's values); InvalidArgument otherwise.
[[nodiscard]] Result<KvCacheDtype> parseKvCacheDtype(std::string_view text);
[[nodiscard]] std::string_view kvCacheDtypeName(KvCacheDtype dtype);
/// The cache's DType (BF16, F8E4M3, F32).
[[nodiscard]] DType kvDType(KvCacheDtype dtype);

/// Bytes one KV block takes on one rank over every KV layer (the latent is replicated per rank):
/// kvLayers x block_size x kvTokenBytes (FP8: the codes plus one F32 scale per 64 values).
[[nodiscard]] std::uint64_t kvBlockBytes(const ModelConfig& config, std::int64_t block_size, KvCacheDtype dtype);

/// One rank's share of the checkpoint layout under tensor parallelism of `tp_size` ranks
/// (docs/tensor-parallel.md's sharding table): q_b / q, kv_b, o_proj, every MLP and expert
/// projection, the embeddings and the heads (with their FP8 scales) are split, ceil(bytes / tp);
/// q_a, kv_a, norms, the router and eh_proj are replicated. tp_size 1 = checkpointLayoutBytes.
[[nodiscard]] std::uint64_t rankWeightBytes(const ModelConfig& config, int tp_size);

/// What the device may hold, as vLLM's --gpu-memory-utilization means it: the process may use
/// `utilization` of the device's total memory; the KV pool takes what is left of that after the
/// weights, the workspace, the CUDA graphs and the runtime's own memory.
struct GpuMemoryBudget {
  std::uint64_t device_total_bytes = 0;  ///< cudaMemGetInfo's total (H200: 141 GB)
  double utilization = 0.9;              ///< in (0, 1]
  int tp_size = 1;                       ///< ranks the weights are split over (one device each)
  std::int64_t kv_block_size = 64;
  KvCacheDtype kv_dtype = KvCacheDtype::Bf16;
  std::int64_t max_batch_tokens = 128;                           ///< workspace: tokens of one forward
  std::int64_t max_context = 32768;                              ///< workspace: longest sequence attended
  std::int64_t max_sample_rows = 64;                             ///< workspace: rows sampled in one step
  std::uint64_t graph_reserve_bytes = std::uint64_t{2} << 30;    ///< captured CUDA graphs (estimate)
  std::uint64_t runtime_reserve_bytes = std::uint64_t{1} << 30;  ///< CUDA context, cuBLAS, NCCL buffers
};

struct KvPoolPlan {
  std::uint64_t budget = 0;           ///< device_total_bytes x utilization
  std::uint64_t weights = 0;          ///< this rank's shard
  std::uint64_t workspace = 0;        ///< activations, attention splits, sampling (per rank)
  std::uint64_t graph_reserve = 0;    ///< as given
  std::uint64_t runtime_reserve = 0;  ///< as given
  std::uint64_t block_bytes = 0;      ///< kvBlockBytes
  std::int64_t num_blocks = 0;        ///< floor(what is left / block_bytes), >= 1
  std::int64_t block_size = 0;
  [[nodiscard]] std::uint64_t kvPoolBytes() const { return static_cast<std::uint64_t>(num_blocks) * block_bytes; }
  [[nodiscard]] std::int64_t kvTokens() const { return num_blocks * block_size; }
};

/// The KV pool's block count for `config` under `budget`. InvalidArgument for a utilization
/// outside (0, 1], a tp_size < 1, non-positive shapes or a zero total; ResourceExhausted naming
/// every part when the budget does not hold the weights, workspace, reserves and one block.
[[nodiscard]] Result<KvPoolPlan> planKvPool(const ModelConfig& config, const GpuMemoryBudget& budget);

/// One line for the log: "KV pool N blocks x 64 tokens (T tokens, bf16, P GB): the budget B GB
/// (0.90 of 141.0 GB) less weights W GB, workspace S GB, CUDA graphs G GB and runtime R GB".
[[nodiscard]] std::string describeKvPoolPlan(const KvPoolPlan& plan, const GpuMemoryBudget& budget);

}  // namespace pd::gpu
