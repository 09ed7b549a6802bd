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
