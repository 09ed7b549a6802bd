// Device memory plan: checkpoint, KV pool and workspace bytes, and the fit check.
#include "device_memory_plan.h"

#include <fmt/format.h>

#include <algorithm>

namespace pd::gpu {
namespace {

using u64 = std::uint64_t;

u64 u(std::int64_t v) {
  return static_cast<u64>(std::max<std::int64_t>(v, 0));
}

std::string gb(u64 bytes) {
  return fmt::format("{:.1f} GB", static_cast<double>(bytes) / 1e9);
}

}  // namespace

std::uint64_t checkpointLayoutBytes(const ModelConfig& config) {
  u64 total = 0;
  for (const TensorSpec& spec : expectedTensors(config)) {
    u64 elements = 1;
    for (const std::int64_t dim : spec.shape) elements *= u(dim);
    total += elements * dtypeSize(spec.dtype);
  }
  return total;
}

Result<DeviceMemoryPlan> planDeviceMemory(const ModelConfig& c, const DeviceServingShape& s) {
  if (s.kv_blocks <= 0 || s.kv_block_size <= 0 || s.max_batch_tokens <= 0 || s.max_context <= 0 ||
      s.max_sample_rows <= 0) {
    return makeError(ErrorCode::InvalidArgument,
                     "device memory plan: kv_blocks, kv_block_size, max_batch_tokens, max_context and "
                     "max_sample_rows must be positive");
  }
  if (s.kv_dtype != DType::F32 && s.kv_dtype != DType::BF16) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("device memory plan: KV dtype {} (only F32 and BF16)", dtypeName(s.kv_dtype)));
  }
  DeviceMemoryPlan plan;
  plan.weights = checkpointLayoutBytes(c);
  plan.kv_pool = u(c.kvLayers()) * u(s.kv_blocks) * u(s.kv_block_size) * u(c.latentDim()) * dtypeSize(s.kv_dtype);

  // Float32 buffers of one forward over T tokens (the first engine's layout; an upper bound).
  const u64 t = u(s.max_batch_tokens);
  const u64 d = u(c.hidden_size);
  const u64 h = u(c.num_attention_heads);
  const u64 qk = u(c.qkHeadDim());
  const u64 ld = u(c.latentDim());
  const u64 dv = u(c.v_head_dim);
  const u64 k = u(c.num_experts_per_tok);
  const u64 splits = (u(s.max_context) + 255) / 256;  // kernels::kMlaSplitPositions
  const u64 shared_width = u(c.moe_intermediate_size) * u(c.n_shared_experts);
  const u64 mlp_width = std::max(u(c.intermediate_size), k * u(c.moe_intermediate_size) + shared_width);
  u64 floats = 0;
  floats += 4 * t * d;                                 // residual, normed input, attention and FFN outputs
  floats += t * (h * qk + u(c.q_lora_rank) + 2 * ld);  // q, q_a, kv_a, latent
  floats += t * h * (2 * ld + dv);                     // q_cat, o_lat, o
  floats += t * h * splits * (ld + 2);                 // split-KV partials
  floats += t * (u(c.n_routed_experts) + k * d + mlp_width + (k + 1) * d);  // router logits, gathered x, act, out
  const u64 rows = u(s.max_sample_rows);
  const u64 vocab = u(c.vocab_size);
  floats += rows * vocab * 6;  // logits, work, sorted keys, ids, sorted ids, sort scratch
  plan.workspace = floats * sizeof(float);
  return plan;
}

Status checkDeviceFit(const DeviceMemoryPlan& plan, std::uint64_t free_bytes, std::uint64_t reserve_bytes,
                      const std::string& device_name) {
  const u64 usable = free_bytes > reserve_bytes ? free_bytes - reserve_bytes : 0;
  if (plan.total() <= usable) return okStatus();
  return makeError(ErrorCode::ResourceExhausted,
                   fmt::format("{}: the model does not fit: weights {} + KV pool {} + workspace {} = {}, but {} "
                               "are free ({} kept in reserve); use fewer KV blocks, more tensor-parallel ranks, "
                               "or FP8 weights",
                               device_name, gb(plan.weights), gb(plan.kv_pool), gb(plan.workspace), gb(plan.total()),
                               gb(free_bytes), gb(reserve_bytes)));
}

}  // namespace pd::gpu
