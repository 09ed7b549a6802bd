// pdserve bench engine --device cuda: the device ceilings, the weight upload, and their report.
#include "bench/engine/device_engine_bench.h"

#include <fmt/format.h>

#include "pd/common/json_text.h"

namespace pd::bench {

Result<DeviceEngineBenchResult> runDeviceEngineBench(const DeviceEngineBenchConfig& config) {
  DeviceEngineBenchResult result;
  PD_ASSIGN_OR_RETURN(result.ceilings, gpu::measureDeviceCeilings(config.ceilings));
  if (!config.model.empty()) {
    PD_ASSIGN_OR_RETURN(result.upload, gpu::measureWeightUpload(config.model, config.ceilings.device));
    PD_ASSIGN_OR_RETURN(result.decode, gpu::measureBatchOneDecode(config.model, config.ceilings.device, config.numerics,
                                                                  config.decode_context, config.decode_steps));
  }
  return result;
}

std::string deviceReportText(const DeviceEngineBenchResult& result) {
  const auto& r = result.ceilings;
  const auto& c = r.config;
  std::string out = fmt::format("device {}\n", r.device);
  out +=
      fmt::format("ceilings: HBM read {:.1f} GB/s ({} MiB streaming read), BF16 GEMM {:.1f} TFLOP/s (cuBLAS, {}^3)\n",
                  r.read_bandwidth / 1e9, c.read_mb, r.gemm_flops / 1e12, c.gemm_size);
  out += fmt::format(
      "MLA decode attention (batch {}, context {}, {} heads, latent {}, BF16 cache): {:.3f} ms, {:.1f} MB read, "
      "{:.1f} GB/s, fraction of HBM bandwidth {:.3f}\n",
      c.attention_batch, c.attention_context, c.attention_heads, c.attention_latent_dim, r.attention_seconds * 1e3,
      r.attention_bytes / 1e6, r.attention_seconds > 0 ? r.attention_bytes / r.attention_seconds / 1e9 : 0.0,
      r.attention_hbm_fraction);
  if (result.upload) {
    const auto& u = *result.upload;
    out += fmt::format("weights {}: {} tensors ({} FP8), {:.2f} GB uploaded in {:.2f} s ({:.2f} GB/s)\n", u.model,
                       u.tensors, u.fp8_tensors, u.bytes / 1e9, u.seconds,
                       u.seconds > 0 ? u.bytes / u.seconds / 1e9 : 0.0);
  }
  if (result.decode) {
    const auto& d = *result.decode;
    out += fmt::format(
        "decode batch 1 ({} numerics, context {}, {} steps): {:.3f} ms/step, {:.1f} MB/step, {:.1f} GB/s, MBU {:.3f}\n",
        gpu::numericsName(d.numerics), d.context, d.steps, d.step_seconds * 1e3, d.bytes_per_step / 1e6,
        d.step_seconds > 0 ? d.bytes_per_step / d.step_seconds / 1e9 : 0.0, gpu::decodeStepMbu(d, r.read_bandwidth));
  } else {
    out += fmt::format("{}\n", kDeviceDecodeNeedsModel);
  }
  out += fmt::format("{}\n", kDevicePrefillMissing);
  return out;
}

std::string deviceReportJson(const DeviceEngineBenchResult& result) {
  const auto& r = result.ceilings;
  const auto& c = r.config;
  std::string upload = "null";
  if (result.upload) {
    const auto& u = *result.upload;
    upload = fmt::format(
        "{{\"model\": {}, \"tensors\": {}, \"fp8_tensors\": {}, \"bytes\": {:.0f}, \"seconds\": {:.4f}, \"gbs\": "
        "{:.3f}}}",
        jsonString(u.model), u.tensors, u.fp8_tensors, u.bytes, u.seconds,
        u.seconds > 0 ? u.bytes / u.seconds / 1e9 : 0.0);
  }
  std::string decode = "null";
  std::string mbu = "null";
  std::string note = fmt::format("{}; {}", kDeviceDecodeNeedsModel, kDevicePrefillMissing);
  if (result.decode) {
    const auto& d = *result.decode;
    decode = fmt::format(
        "{{\"numerics\": \"{}\", \"context\": {}, \"steps\": {}, \"step_ms\": {:.4f}, \"bytes_per_step\": {:.0f}, "
        "\"gbs\": {:.3f}}}",
        gpu::numericsName(d.numerics), d.context, d.steps, d.step_seconds * 1e3, d.bytes_per_step,
        d.step_seconds > 0 ? d.bytes_per_step / d.step_seconds / 1e9 : 0.0);
    mbu = fmt::format("{:.4f}", gpu::decodeStepMbu(d, r.read_bandwidth));
    note = kDevicePrefillMissing;
  }
  return fmt::format(
      "{{\"backend\": \"cuda\", \"device\": {}, \"read_bandwidth_gbs\": {:.3f}, \"read_mb\": {}, "
      "\"gemm_bf16_tflops\": {:.3f}, \"gemm_size\": {}, \"attention_hbm_fraction\": {:.4f}, \"attention_ms\": {:.4f}, "
      "\"attention_bytes\": {:.0f}, \"attention_batch\": {}, \"attention_context\": {}, \"attention_heads\": {}, "
      "\"attention_latent_dim\": {}, \"mbu_batch1\": {}, \"decode\": {}, \"prefill_gemm_fraction\": null, "
      "\"note\": {}, \"weight_upload\": {}}}",
      jsonString(r.device), r.read_bandwidth / 1e9, c.read_mb, r.gemm_flops / 1e12, c.gemm_size,
      r.attention_hbm_fraction, r.attention_seconds * 1e3, r.attention_bytes, c.attention_batch, c.attention_context,
      c.attention_heads, c.attention_latent_dim, mbu, decode, jsonString(note), upload);
}

}  // namespace pd::bench
