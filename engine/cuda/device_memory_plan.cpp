// Device memory plan: checkpoint, KV pool and workspace bytes, and the fit check.
#include "device_memory_plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>

namespace pd::gpu {
namespace {

using u64 = std::uint64_t;

u64 u(std::int64_t v) {
  return static_cast<u64>(std::max<std::int64_t>(v, 0));
}

std::string gb(u64 bytes) {
  return fmt::format("{:.1f} GB", static_cast<double>(bytes) / 1e9);
}

// Float32 buffers of one forward over T tokens (the first engine's layout; an upper bound).
u64 workspaceBytes(const ModelConfig& c, std::int64_t max_batch_tokens, std::int64_t max_context,
                   std::int64_t max_sample_rows) {
  const u64 t = u(max_batch_tokens);
  const u64 d = u(c.hidden_size);
  const u64 h = u(c.num_attention_heads);
  const u64 qk = u(c.qkHeadDim());
  const u64 ld = u(c.latentDim());
  const u64 dv = u(c.v_head_dim);
  const u64 k = u(c.num_experts_per_tok);
  const u64 splits = (u(max_context) + 255) / 256;  // kernels::kMlaSplitPositions
  const u64 shared_width = u(c.moe_intermediate_size) * u(c.n_shared_experts);
  const u64 mlp_width = std::max(u(c.intermediate_size), k * u(c.moe_intermediate_size) + shared_width);
  u64 floats = 0;
  floats += 4 * t * d;                                 // residual, normed input, attention and FFN outputs
  floats += t * (h * qk + u(c.q_lora_rank) + 2 * ld);  // q, q_a, kv_a, latent
  floats += t * h * (2 * ld + dv);                     // q_cat, o_lat, o
  floats += t * h * splits * (ld + 2);                 // split-KV partials
  floats += 256 * (ld + h * (u(c.qk_nope_head_dim) + dv)) + t * h * (dv + 2);  // prefill attention's chunk and state
  floats += t * (u(c.n_routed_experts) + k * d + mlp_width + (k + 1) * d);     // router logits, gathered x, act, out
  const u64 rows = u(max_sample_rows);
  const u64 vocab = u(c.vocab_size);
  floats += rows * vocab * 6;  // logits, work, sorted keys, ids, sorted ids, sort scratch
  return floats * sizeof(float);
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
  if (!isKvDType(s.kv_dtype)) {
    return makeError(
        ErrorCode::InvalidArgument,
        fmt::format("device memory plan: KV dtype {} (only F32, BF16 and F8_E4M3)", dtypeName(s.kv_dtype)));
  }
  DeviceMemoryPlan plan;
  plan.weights = checkpointLayoutBytes(c);
  plan.kv_pool = u(c.kvLayers()) * u(s.kv_blocks) * u(s.kv_block_size) * kvTokenBytes(s.kv_dtype, c.latentDim());

  plan.workspace = workspaceBytes(c, s.max_batch_tokens, s.max_context, s.max_sample_rows);
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

Result<KvCacheDtype> parseKvCacheDtype(std::string_view text) {
  if (text == "bf16") return KvCacheDtype::Bf16;
  if (text == "fp8") return KvCacheDtype::Fp8E4m3;
  return makeError(ErrorCode::InvalidArgument, fmt::format("kv_cache_dtype '{}' is not one of bf16, fp8", text));
}

DType kvDType(KvCacheDtype dtype) {
  return dtype == KvCacheDtype::Bf16 ? DType::BF16 : dtype == KvCacheDtype::F32 ? DType::F32 : DType::F8E4M3;
}

std::string_view kvCacheDtypeName(KvCacheDtype dtype) {
  return dtype == KvCacheDtype::Bf16 ? "bf16" : dtype == KvCacheDtype::F32 ? "f32" : "fp8";
}

std::uint64_t kvBlockBytes(const ModelConfig& config, std::int64_t block_size, KvCacheDtype dtype) {
  return u(config.kvLayers()) * u(block_size) * kvTokenBytes(kvDType(dtype), config.latentDim());
}

std::uint64_t rankWeightBytes(const ModelConfig& config, int tp_size) {
  // The sharded tensors of docs/tensor-parallel.md, by name; a weight's _scale_inv follows it.
  static constexpr std::array<std::string_view, 10> kSharded{
      "self_attn.q_b_proj.", "self_attn.q_proj.", "self_attn.kv_b_proj.",
      "self_attn.o_proj.",   "gate_proj.",        "up_proj.",
      "down_proj.",          "embed_tokens.",     "lm_head.",
      "shared_head.head."};
  const u64 tp = u(std::max(tp_size, 1));
  u64 total = 0;
  for (const TensorSpec& spec : expectedTensors(config)) {
    u64 bytes = dtypeSize(spec.dtype);
    for (const std::int64_t dim : spec.shape) bytes *= u(dim);
    const bool sharded = std::any_of(kSharded.begin(), kSharded.end(),
                                     [&](std::string_view part) { return spec.name.find(part) != std::string::npos; });
    total += sharded ? (bytes + tp - 1) / tp : bytes;
  }
  return total;
}

Result<KvPoolPlan> planKvPool(const ModelConfig& config, const GpuMemoryBudget& b) {
  if (!(b.utilization > 0.0 && b.utilization <= 1.0)) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("gpu_memory_utilization {} is not in (0, 1]", b.utilization));
  }
  if (b.device_total_bytes == 0 || b.tp_size < 1 || b.kv_block_size <= 0 || b.max_batch_tokens <= 0 ||
      b.max_context <= 0 || b.max_sample_rows <= 0) {
    return makeError(ErrorCode::InvalidArgument,
                     "KV pool plan: device memory, tp_size, kv_block_size, max_batch_tokens, max_context and "
                     "max_sample_rows must be positive");
  }
  KvPoolPlan plan;
  plan.budget = static_cast<u64>(std::floor(static_cast<double>(b.device_total_bytes) * b.utilization));
  plan.weights = rankWeightBytes(config, b.tp_size);
  // The rank's activations: its heads and its slice of every MLP (the hidden size stays whole).
  ModelConfig shard = config;
  const auto per_rank = [&](std::int64_t v) { return (v + b.tp_size - 1) / b.tp_size; };
  shard.num_attention_heads = per_rank(config.num_attention_heads);
  shard.intermediate_size = per_rank(config.intermediate_size);
  shard.moe_intermediate_size = per_rank(config.moe_intermediate_size);
  plan.workspace = workspaceBytes(shard, b.max_batch_tokens, b.max_context, b.max_sample_rows);
  plan.graph_reserve = b.graph_reserve_bytes;
  plan.runtime_reserve = b.runtime_reserve_bytes;
  plan.block_bytes = kvBlockBytes(config, b.kv_block_size, b.kv_dtype);
  plan.block_size = b.kv_block_size;
  const u64 fixed = plan.weights + plan.workspace + plan.graph_reserve + plan.runtime_reserve;
  if (fixed + plan.block_bytes > plan.budget) {
    return makeError(ErrorCode::ResourceExhausted,
                     fmt::format("no room for a KV pool: {} of {} (gpu_memory_utilization {:.2f}) holds weights {} "
                                 "(tensor parallel {}) + workspace {} + CUDA graphs {} + runtime {} = {}, and a "
                                 "block needs {} more; raise gpu_memory_utilization or tensor parallelism",
                                 gb(plan.budget), gb(b.device_total_bytes), b.utilization, gb(plan.weights), b.tp_size,
                                 gb(plan.workspace), gb(plan.graph_reserve), gb(plan.runtime_reserve), gb(fixed),
                                 fmt::format("{:.1f} MB", static_cast<double>(plan.block_bytes) / 1e6)));
  }
  plan.num_blocks = static_cast<std::int64_t>((plan.budget - fixed) / plan.block_bytes);
  return plan;
}

std::string describeKvPoolPlan(const KvPoolPlan& plan, const GpuMemoryBudget& budget) {
  return fmt::format(
      "KV pool {} blocks x {} tokens ({} tokens, {}, {}): the budget {} ({:.2f} of {}) less weights {}, "
      "workspace {}, CUDA graphs {} and runtime {}",
      plan.num_blocks, plan.block_size, plan.kvTokens(), kvCacheDtypeName(budget.kv_dtype), gb(plan.kvPoolBytes()),
      gb(plan.budget), budget.utilization, gb(budget.device_total_bytes), gb(plan.weights), gb(plan.workspace),
      gb(plan.graph_reserve), gb(plan.runtime_reserve));
}

}  // namespace pd::gpu
