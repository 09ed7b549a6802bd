// loadServingEngine (serving_engine.h).
#include "pd/engine/serving_engine.h"

#include <utility>

#include "../cuda/device_memory_plan.h"  // host arithmetic, in every build
#include "pd/engine/cuda_engine.h"

namespace pd::model {

Result<ServingEngine> loadServingEngine(const std::filesystem::path& model_dir, int threads,
                                        comm::TpProcessGroup* group, const gpu::ModelDevice& device,
                                        bool batch_invariant, gpu::Numerics numerics, bool cuda_graphs,
                                        comm::Communicator* device_group) {
  if (device.kind == gpu::ModelDevice::Kind::Cuda) {
    CudaEngineOptions options;
    options.device = device;
    options.numerics = numerics;
    options.cuda_graphs = cuda_graphs;
    options.batch_invariant = batch_invariant;
    PD_TRY(checkCudaEngineOptions(options));
    if (group != nullptr) options.tp = device_group != nullptr ? device_group : &group->comm();
    PD_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, createCudaEngine(model_dir, options));
    ServingEngine out;
    out.engine = std::move(engine);
    if (group != nullptr) {  // the CUDA engine samples on the device: so does its leader
      std::unique_ptr<TpLeaderEngine> wrapped = makeTpLeaderEngine(std::move(out.engine), group->comm());
      out.tp_leader = wrapped.get();
      out.engine = std::move(wrapped);
    }
    return out;
  }
  PD_TRY(gpu::checkNumericsOnDevice(device, numerics));
  CpuEngineOptions options;
  options.threads = threads;
  options.batch_invariant = batch_invariant;
  if (group != nullptr) options.tp = &group->comm();
  PD_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, createCpuEngine(model_dir, options));
  ServingEngine out;
  out.engine = std::move(engine);
  if (group != nullptr) {
    auto wrapped = std::make_unique<TpLeaderEngine>(std::move(out.engine), group->comm());
    out.tp_leader = wrapped.get();
    out.engine = std::move(wrapped);
  }
  return out;
}

Result<GpuKvPoolSize> planGpuKvPool(const ModelConfig& config, std::uint64_t device_total_bytes, double utilization,
                                    int tp_size, std::int64_t block_size, DType kv_dtype) {
  if (kv_dtype != DType::F32 && kv_dtype != DType::BF16) {
    return makeError(ErrorCode::InvalidArgument, "GPU KV pool: the pool is F32 or BF16");
  }
  gpu::GpuMemoryBudget budget;
  budget.device_total_bytes = device_total_bytes;
  budget.utilization = utilization;
  budget.tp_size = tp_size;
  budget.kv_block_size = block_size;
  budget.kv_dtype = kv_dtype == DType::F32 ? gpu::KvCacheDtype::F32 : gpu::KvCacheDtype::Bf16;
  PD_ASSIGN_OR_RETURN(const gpu::KvPoolPlan plan, gpu::planKvPool(config, budget));
  return GpuKvPoolSize{plan.num_blocks, gpu::describeKvPoolPlan(plan, budget)};
}

}  // namespace pd::model
