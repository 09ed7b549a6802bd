#pragma once
/// The engine a worker process serves with (prefill::runWorker, decode::runWorker): the CPU or CUDA
/// engine of this rank's shard, wrapped in a TpLeaderEngine when the process leads a tensor-parallel group.
/// Thread rules: the worker's main thread, at start-up.

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>

#include "pd/comm/process_group.h"
#include "pd/common/result.h"
#include "pd/engine/engine.h"
#include "pd/engine/gpu.h"
#include "pd/engine/tp_engine.h"

namespace pd::model {

struct ServingEngine {
  std::unique_ptr<Engine> engine;
  TpLeaderEngine* tp_leader = nullptr;  ///< inside `engine` when `group` was given; else null
};

/// Loads `model_dir` with `threads` compute threads; with `group` (may be null) the engine is rank
/// 0's shard of the group's communicator, wrapped in a TpLeaderEngine. A CUDA `device` loads the
/// CUDA engine (pd/engine/cuda_engine.h) instead; with a group its collectives run over
/// `device_group` (the NCCL communicator joined over `group`) when given, else staged over the
/// group itself (CudaEngineOptions::tp). `batch_invariant`: CpuEngineOptions::batch_invariant
/// (Unsupported on CUDA). `numerics`: CudaEngineOptions::numerics (anything but Fp32 is
/// InvalidArgument on the CPU). `cuda_graphs`: CudaEngineOptions::cuda_graphs (ignored on the CPU).
[[nodiscard]] Result<ServingEngine> loadServingEngine(const std::filesystem::path& model_dir, int threads,
                                                      comm::TpProcessGroup* group, const gpu::ModelDevice& device = {},
                                                      bool batch_invariant = false,
                                                      gpu::Numerics numerics = gpu::Numerics::Fp32,
                                                      bool cuda_graphs = true,
                                                      comm::Communicator* device_group = nullptr);

/// One rank's engine, as loadServingEngine loads rank 0's (without the TpLeaderEngine): the CPU
/// engine (its shard of `tp` when given), or for a CUDA `device` the CUDA engine, whose
/// collectives run over `device_group` when given, else over `tp`. The follower ranks of a
/// worker's group load theirs with it, on their own device index.
[[nodiscard]] Result<std::unique_ptr<Engine>> loadRankEngine(const std::filesystem::path& model_dir, int threads,
                                                             comm::Communicator* tp, const gpu::ModelDevice& device,
                                                             bool batch_invariant, gpu::Numerics numerics,
                                                             bool cuda_graphs, comm::Communicator* device_group);

/// How many KV blocks a decode pool gets on a GPU (docs/gpu.md "The GPU memory plan"): what
/// `utilization` of the device's `device_total_bytes` leaves after this rank's weights (split over
/// `tp_size` ranks), its workspace and the graph and runtime reserves, in blocks of `block_size`
/// tokens of `kv_dtype` (F32 or BF16). `description` is the plan's line for the log.
/// ResourceExhausted naming every part when not one block fits; InvalidArgument for bad values.
struct GpuKvPoolSize {
  std::int64_t num_blocks = 0;
  std::string description;
};
[[nodiscard]] Result<GpuKvPoolSize> planGpuKvPool(const ModelConfig& config, std::uint64_t device_total_bytes,
                                                  double utilization, int tp_size, std::int64_t block_size,
                                                  DType kv_dtype);

}  // namespace pd::model
