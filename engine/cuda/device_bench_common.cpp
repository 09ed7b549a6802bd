// Host arithmetic of the device ceilings (pd/engine/gpu_bench.h), in every build.
#include <fmt/format.h>

#include "pd/engine/gpu_bench.h"

namespace pd::gpu {

double attentionMinimumBytes(const DeviceCeilingsConfig& c, std::int64_t cache_element_bytes) {
  const double cache = static_cast<double>(c.attention_batch) * static_cast<double>(c.attention_context) *
                       static_cast<double>(c.attention_latent_dim) * static_cast<double>(cache_element_bytes);
  const double queries = static_cast<double>(c.attention_batch) * static_cast<double>(c.attention_heads) *
                         static_cast<double>(c.attention_latent_dim) * 4.0;
  return cache + queries;
}

double bandwidthFraction(double bytes, double seconds, double bandwidth) {
  if (!(bytes > 0.0) || !(seconds > 0.0) || !(bandwidth > 0.0)) return 0.0;
  return bytes / seconds / bandwidth;
}

double devicePrefillFlops(const ModelConfig& c, std::int64_t tokens) {
  if (tokens <= 0) return 0.0;
  const auto n = static_cast<double>(tokens);
  const auto d = static_cast<double>(c.hidden_size);
  const auto heads = static_cast<double>(c.num_attention_heads);
  const auto qk = static_cast<double>(c.qkHeadDim());
  const auto dn = static_cast<double>(c.qk_nope_head_dim);
  const auto dv = static_cast<double>(c.v_head_dim);
  const auto r = static_cast<double>(c.kv_lora_rank);
  const auto ld = static_cast<double>(c.latentDim());
  const double attended = n * (n + 1.0) / 2.0;  // (query, key) pairs of a causal prompt
  // Per token and layer: the attention's linears.
  double linear = c.q_lora_rank > 0
                      ? d * static_cast<double>(c.q_lora_rank) + static_cast<double>(c.q_lora_rank) * heads * qk
                      : d * heads * qk;
  linear += d * ld + heads * dv * d;
  double flops = 0.0;
  for (std::int64_t l = 0; l < c.num_hidden_layers; ++l) {
    double mlp = 0.0;
    if (c.isMoeLayer(l)) {
      const auto width = static_cast<double>(c.moe_intermediate_size);
      mlp = d * static_cast<double>(c.n_routed_experts) +
            3.0 * d * width * static_cast<double>(c.num_experts_per_tok + c.n_shared_experts);
    } else {
      mlp = 3.0 * d * static_cast<double>(c.intermediate_size);
    }
    flops += 2.0 * n * (linear + mlp);
    flops += 2.0 * attended * heads * (ld + r) + 2.0 * n * heads * (dn + dv) * r;
  }
  return flops + 2.0 * d * static_cast<double>(c.vocab_size);  // the last row's logits
}

double prefillGemmFraction(const PrefillResult& prefill, double gemm_flops) {
  if (!(prefill.flops > 0.0) || !(prefill.seconds > 0.0) || !(gemm_flops > 0.0)) return 0.0;
  return prefill.flops / prefill.seconds / gemm_flops;
}

double decodeStepMbu(const DecodeStepResult& step, double read_bandwidth) {
  return bandwidthFraction(step.bytes_per_step, step.step_seconds, read_bandwidth);
}

Status validateDeviceDecodeBenchConfig(const DeviceDecodeBenchConfig& c) {
  const auto bad = [](std::string what) {
    return makeError(ErrorCode::InvalidArgument, "bench engine --device cuda: " + std::move(what));
  };
  if (c.context < 1 || c.context > 65536 || c.steps < 1 || c.steps > 65536) {
    return bad(fmt::format("decode context {} and steps {} must be in 1..65536", c.context, c.steps));
  }
  if (c.prefill_tokens < 0 || c.prefill_tokens > 65536 || c.prefill_repetitions < 1 || c.prefill_repetitions > 1000) {
    return bad(fmt::format("prefill tokens {} must be in 0..65536 and repetitions {} in 1..1000", c.prefill_tokens,
                           c.prefill_repetitions));
  }
  if (c.batches.empty()) return bad("no decode batch sizes");
  for (const std::int64_t b : c.batches) {
    if (b < 1 || b > kMaxDeviceDecodeBatch) {
      return bad(fmt::format("decode batch {} is outside 1..{} (a decode step's limit)", b, kMaxDeviceDecodeBatch));
    }
  }
  return okStatus();
}

Status validateDeviceCeilingsConfig(const DeviceCeilingsConfig& c) {
  const auto check = [](std::string_view name, std::int64_t value, std::int64_t lo, std::int64_t hi) -> Status {
    if (value < lo || value > hi) {
      return makeError(ErrorCode::InvalidArgument,
                       fmt::format("bench engine --device cuda: {} = {} is outside [{}, {}]", name, value, lo, hi));
    }
    return okStatus();
  };
  PD_TRY(check("read_mb", c.read_mb, 64, std::int64_t{1} << 20));
  PD_TRY(check("gemm_size", c.gemm_size, 256, 65536));
  PD_TRY(check("iterations", c.iterations, 1, 10000));
  PD_TRY(check("attention_batch", c.attention_batch, 1, 1024));
  PD_TRY(check("attention_context", c.attention_context, 1, std::int64_t{1} << 20));
  PD_TRY(check("attention_heads", c.attention_heads, 1, 1024));
  PD_TRY(check("attention_latent_dim", c.attention_latent_dim, 1, 1024));
  PD_TRY(check("attention_block_size", c.attention_block_size, 1, 4096));
  if (c.device.kind != ModelDevice::Kind::Cuda) {
    return makeError(ErrorCode::InvalidArgument, "bench engine: the device ceilings need a CUDA device");
  }
  return okStatus();
}

}  // namespace pd::gpu
