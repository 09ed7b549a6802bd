// loadServingEngine (serving_engine.h).
#include "pd/engine/serving_engine.h"

#include <utility>

#include "../cuda/device_memory_plan.h"  // host arithmetic, in every build
#include "pd/engine/cuda_engine.h"

namespace pd::model {

Result<std::unique_ptr<Engine>> loadRankEngine(const std::filesystem::path& model_dir, int threads,
                                               comm::Communicator* tp, const gpu::ModelDevice& device,
                                               bool batch_invariant, gpu::Numerics numerics, bool cuda_graphs,
                                               comm::Communicator* device_group) {
  if (device.kind == gpu::ModelDevice::Kind::Cuda) {
    CudaEngineOptions options;
    options.device = device;
    options.numerics = numerics;
    options.cuda_graphs = cuda_graphs;
    options.batch_invariant = batch_invariant;
    PD_TRY(checkCudaEngineOptions(options));
    if (tp != nullptr) options.tp = device_group != nullptr ? device_group : tp;
    return createCudaEngine(model_dir, options);
  }
  PD_TRY(gpu::checkNumericsOnDevice(device, numerics));
  CpuEngineOptions options;
  options.threads = threads;
  options.batch_invariant = batch_invariant;
  options.tp = tp;
  return createCpuEngine(model_dir, options);
}

Result<ServingEngine> loadServingEngine(const std::filesystem::path& model_dir, int threads,
                                        comm::TpProcessGroup* group, const gpu::ModelDevice& device,
                                        bool batch_invariant, gpu::Numerics numerics, bool cuda_graphs,
                                        comm::Communicator* device_group) {
  comm::Communicator* const tp = group != nullptr ? &group->comm() : nullptr;
  ServingEngine out;
  PD_ASSIGN_OR_RETURN(
      out.engine, loadRankEngine(model_dir, threads, tp, device, batch_invariant, numerics, cuda_graphs, device_group));
  if (tp != nullptr) {  // a leader over an engine that samples (CUDA) samples too
    std::unique_ptr<TpLeaderEngine> wrapped = makeTpLeaderEngine(std::move(out.engine), *tp);
    out.tp_leader = wrapped.get();
    out.engine = std::move(wrapped);
  }
  return out;
}

Result<GpuKvPoolSize> planGpuKvPool(const ModelConfig& config, std::uint64_t device_total_bytes, double utilization,
                                    int tp_size, std::int64_t block_size, DType kv_dtype) {
  if (!isKvDType(kv_dtype)) return makeError(ErrorCode::InvalidArgument, "GPU KV pool: the pool is F32, BF16 or FP8");
  gpu::GpuMemoryBudget budget;
  budget.device_total_bytes = device_total_bytes;
  budget.utilization = utilization;
  budget.tp_size = tp_size;
  budget.kv_block_size = block_size;
  budget.kv_dtype = kv_dtype == DType::F32    ? gpu::KvCacheDtype::F32
                    : kv_dtype == DType::BF16 ? gpu::KvCacheDtype::Bf16
                                              : gpu::KvCacheDtype::Fp8E4m3;
  PD_ASSIGN_OR_RETURN(const gpu::KvPoolPlan plan, gpu::planKvPool(config, budget));
  return GpuKvPoolSize{plan.num_blocks, gpu::describeKvPoolPlan(plan, budget)};
}

}  // namespace pd::model
