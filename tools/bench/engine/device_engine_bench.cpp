// pdserve bench engine --device cuda: the device ceilings, the weight upload, and their report.
#include "bench/engine/device_engine_bench.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <string>
#include <vector>

#include "pd/common/json_text.h"

namespace pd::bench {

namespace {

double gbs(double bytes, double seconds) {
  return seconds > 0 ? bytes / seconds / 1e9 : 0.0;
}

const gpu::DecodeStepResult* batchOne(const DeviceEngineBenchResult& result) {
  for (const auto& d : result.decode) {
    if (d.batch == 1) return &d;
  }
  return nullptr;
}

}  // namespace

Result<DeviceEngineBenchResult> runDeviceEngineBench(const DeviceEngineBenchConfig& config) {
  DeviceEngineBenchResult result;
  gpu::DeviceDecodeBenchConfig decode;
  decode.numerics = config.numerics;
  decode.context = config.decode_context;
  decode.steps = config.decode_steps;
  decode.cuda_graphs = config.cuda_graphs;
  decode.prefill_tokens = config.prefill_tokens;
  decode.batches.clear();
  for (const std::int64_t b : config.batches) {
    if (b > gpu::kMaxDeviceDecodeBatch) {
      result.unmeasured_batches.push_back(b);
    } else {
      decode.batches.push_back(b);
    }
  }
  if (!config.model.empty()) {
    if (decode.batches.empty()) {
      return makeError(
          ErrorCode::InvalidArgument,
          fmt::format("bench engine --device cuda: no batch of 1..{} to measure", gpu::kMaxDeviceDecodeBatch));
    }
    PD_TRY(gpu::validateDeviceDecodeBenchConfig(decode));
  }
  PD_ASSIGN_OR_RETURN(result.ceilings, gpu::measureDeviceCeilings(config.ceilings));
  if (!config.model.empty()) {
    PD_ASSIGN_OR_RETURN(gpu::ModelOnDeviceResult measured,
                        gpu::measureModelOnDevice(config.model, config.ceilings.device, decode));
    result.upload = measured.upload;
    result.decode = std::move(measured.decode);
    result.prefill = measured.prefill;
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
      r.attention_bytes / 1e6, gbs(r.attention_bytes, r.attention_seconds), r.attention_hbm_fraction);
  if (result.upload) {
    const auto& u = *result.upload;
    out += fmt::format("weights {}: {} tensors ({} FP8), {:.2f} GB uploaded in {:.2f} s ({:.2f} GB/s)\n", u.model,
                       u.tensors, u.fp8_tensors, u.bytes / 1e9, u.seconds, gbs(u.bytes, u.seconds));
  }
  for (const auto& d : result.decode) {
    out += fmt::format(
        "decode batch {} ({} numerics, context {}, {} steps): {:.3f} ms/step, {:.1f} tokens/s, {:.1f} experts per MoE "
        "layer, {:.1f} MB/step, {:.1f} GB/s, MBU {:.3f}{}\n",
        d.batch, gpu::numericsName(d.numerics), d.context, d.steps, d.step_seconds * 1e3,
        d.step_seconds > 0 ? static_cast<double>(d.batch) / d.step_seconds : 0.0, d.experts_used,
        d.bytes_per_step / 1e6, gbs(d.bytes_per_step, d.step_seconds), gpu::decodeStepMbu(d, r.read_bandwidth),
        d.cuda_graphs ? ", CUDA graphs" : ", eager");
  }
  if (result.decode.empty()) out += fmt::format("{}\n", kDeviceDecodeNeedsModel);
  if (!result.unmeasured_batches.empty()) out += fmt::format("{}\n", kDeviceBatchOverStep);
  if (result.prefill) {
    const auto& p = *result.prefill;
    out += fmt::format(
        "prefill {} tokens ({} numerics, rows of decode steps): {:.3f} s, {:.1f} tokens/s, {:.2f} TFLOP/s, fraction "
        "of the BF16 GEMM ceiling {:.4f}{}\n",
        p.tokens, gpu::numericsName(p.numerics), p.seconds,
        p.seconds > 0 ? static_cast<double>(p.tokens) / p.seconds : 0.0,
        p.seconds > 0 ? p.flops / p.seconds / 1e12 : 0.0, gpu::prefillGemmFraction(p, r.gemm_flops),
        p.cuda_graphs ? ", CUDA graphs" : ", eager");
  } else {
    out += fmt::format("{}\n", kDevicePrefillMissing);
  }
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
        jsonString(u.model), u.tensors, u.fp8_tensors, u.bytes, u.seconds, gbs(u.bytes, u.seconds));
  }
  std::string decode;
  std::string by_batch;
  for (const auto& d : result.decode) {
    if (!decode.empty()) decode += ", ";
    decode += fmt::format(
        "{{\"batch\": {}, \"numerics\": \"{}\", \"context\": {}, \"steps\": {}, \"step_ms\": {:.4f}, "
        "\"tokens_per_s\": {:.3f}, \"experts_per_moe_layer\": {:.2f}, \"bytes_per_step\": {:.0f}, \"gbs\": {:.3f}, "
        "\"mbu\": {:.4f}, \"cuda_graphs\": {}}}",
        d.batch, gpu::numericsName(d.numerics), d.context, d.steps, d.step_seconds * 1e3,
        d.step_seconds > 0 ? static_cast<double>(d.batch) / d.step_seconds : 0.0, d.experts_used, d.bytes_per_step,
        gbs(d.bytes_per_step, d.step_seconds), gpu::decodeStepMbu(d, r.read_bandwidth), d.cuda_graphs);
    if (!by_batch.empty()) by_batch += ", ";
    by_batch += fmt::format("\"{}\": {:.4f}", d.batch, gpu::decodeStepMbu(d, r.read_bandwidth));
  }
  if (!result.decode.empty()) {
    for (const std::int64_t b : result.unmeasured_batches) by_batch += fmt::format(", \"{}\": null", b);
  }
  const gpu::DecodeStepResult* one = batchOne(result);
  const std::string mbu = one != nullptr ? fmt::format("{:.4f}", gpu::decodeStepMbu(*one, r.read_bandwidth)) : "null";
  std::vector<std::string> notes;
  if (result.decode.empty()) notes.emplace_back(kDeviceDecodeNeedsModel);
  if (!result.prefill) notes.emplace_back(kDevicePrefillMissing);
  if (!result.decode.empty() && !result.unmeasured_batches.empty()) notes.emplace_back(kDeviceBatchOverStep);
  const std::string note = fmt::format("{}", fmt::join(notes, "; "));
  std::string prefill = "null";
  std::string fraction = "null";
  if (result.prefill) {
    const auto& p = *result.prefill;
    fraction = fmt::format("{:.5f}", gpu::prefillGemmFraction(p, r.gemm_flops));
    prefill = fmt::format(
        "{{\"tokens\": {}, \"numerics\": \"{}\", \"repetitions\": {}, \"seconds\": {:.5f}, \"tokens_per_s\": {:.3f}, "
        "\"flops\": {:.0f}, \"tflops\": {:.4f}, \"cuda_graphs\": {}}}",
        p.tokens, gpu::numericsName(p.numerics), p.repetitions, p.seconds,
        p.seconds > 0 ? static_cast<double>(p.tokens) / p.seconds : 0.0, p.flops,
        p.seconds > 0 ? p.flops / p.seconds / 1e12 : 0.0, p.cuda_graphs);
  }
  return fmt::format(
      "{{\"backend\": \"cuda\", \"device\": {}, \"read_bandwidth_gbs\": {:.3f}, \"read_mb\": {}, "
      "\"gemm_bf16_tflops\": {:.3f}, \"gemm_size\": {}, \"attention_hbm_fraction\": {:.4f}, \"attention_ms\": {:.4f}, "
      "\"attention_bytes\": {:.0f}, \"attention_batch\": {}, \"attention_context\": {}, \"attention_heads\": {}, "
      "\"attention_latent_dim\": {}, \"mbu_batch1\": {}, \"mbu_by_batch\": {{{}}}, \"decode\": [{}], "
      "\"prefill_gemm_fraction\": {}, \"prefill\": {}, \"note\": {}, \"weight_upload\": {}}}",
      jsonString(r.device), r.read_bandwidth / 1e9, c.read_mb, r.gemm_flops / 1e12, c.gemm_size,
      r.attention_hbm_fraction, r.attention_seconds * 1e3, r.attention_bytes, c.attention_batch, c.attention_context,
      c.attention_heads, c.attention_latent_dim, mbu, by_batch, decode, fraction, prefill, jsonString(note), upload);
}

}  // namespace pd::bench
