#pragma once
/// The CUDA backend of the Engine seam (engine/cuda/cuda_engine.cpp; docs/gpu.md): the whole
/// DeepSeek-V3 forward on one device, in the `fp32` numerics mode (FP32 activations and
/// accumulation, exact against the CPU engine within the golden tolerances) or the `bf16` one
/// (gpu::Numerics). `--model.device cuda[:N]` selects it, `--model.numerics` the mode.
///
/// The caller's LatentCacheView (host memory: a PagedLatentCache or a worker's registered pool)
/// stays the source of truth, so the pool and KV transfer code work unchanged: the engine keeps a
/// device latent cache of the same geometry, copies the positions a call attends to ([0,
/// start_pos) of each sequence, every KV layer the call runs) from the host cache into it, and
/// mirrors each step's new latents back into the host cache (and hands them to the sink), layer by
/// layer, after the step: one device-to-host copy per layer into pinned memory inside the step, no
/// synchronize per layer, so steps replay CUDA graphs (CudaEngineOptions::cuda_graphs). For a BF16
/// host cache the latents are rounded to BF16 on the device first, so the device cache holds what
/// the host cache holds. This is the interim design until the device KV pool (issue 18) makes the
/// device cache the source: its cost is one host-to-device copy of every attended prefix per call.
///
/// Thread rules: as model::Engine (one thread at a time); the engine owns one stream.
/// Errors: as the CPU engine (InvalidArgument for a malformed batch, nothing written); in a
/// CPU-only build, or without a visible device, createCudaEngine is Unsupported "no CUDA device".

#include <cstdint>
#include <filesystem>
#include <memory>

#include "pd/common/result.h"
#include "pd/engine/engine.h"
#include "pd/engine/gpu.h"

namespace pd::model {

struct CudaEngineOptions {
  gpu::ModelDevice device{gpu::ModelDevice::Kind::Cuda, 0};
  /// Rows (new tokens) one device step runs; a call with more runs several steps in row order
  /// (1..64: the FP8 GEMV's token limit).
  std::int64_t max_step_rows = 64;
  /// What the fit check before the weight upload reserves for the device latent cache: blocks of
  /// kv_block_size positions (per KV layer). 0: one sequence of max_position_embeddings.
  std::int64_t kv_blocks = 0;
  std::int64_t kv_block_size = 64;
  /// Fp32 (the parity mode) or Bf16 (BF16 linears as stored, FP32 accumulation; gpu.h Numerics).
  gpu::Numerics numerics = gpu::Numerics::Fp32;
  /// model.cuda_graphs: decode steps replay CUDA graphs (DeviceDecodeStep::Options::cuda_graphs).
  bool cuda_graphs = true;
  /// model.batch_invariant: the CUDA engine has no such mode; createCudaEngine refuses it.
  bool batch_invariant = false;
  /// Tensor parallelism (docs/tensor-parallel.md, "On GPUs"): this engine is rank tp->rank() of
  /// tp->size(), uploads only that rank's shard of the weights and sums / gathers over the group
  /// inside each step, so that outputs are whole on every rank, as with CpuEngineOptions::tp.
  /// The group's device collectives are used when it has them (NCCL: on the device buffers, inside
  /// CUDA graphs); otherwise they are staged through pinned host memory over `tp` itself (ranks
  /// sharing one GPU, tests), and steps run without graphs. Not owned; null or size 1: one rank.
  comm::Communicator* tp = nullptr;
};

/// The checks createCudaEngine makes before it looks for a device (every build): Unsupported for
/// batch_invariant.
[[nodiscard]] Status checkCudaEngineOptions(const CudaEngineOptions& options);

/// Uploads the checkpoint in `model_dir` to the device and binds the model. Unsupported "no CUDA
/// device" without one; InvalidArgument for a bad device index or a model the kernels do not run;
/// ResourceExhausted naming each part when it does not fit the device; NotFound for a missing
/// tensor.
Result<std::unique_ptr<Engine>> createCudaEngine(const std::filesystem::path& model_dir,
                                                 const CudaEngineOptions& options = {});

}  // namespace pd::model
