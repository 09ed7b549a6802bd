// pdserve bench engine: decode MBU and prefill FLOP utilization of the CPU engine against
// ceilings measured in the same run; with --device cuda, the CUDA device's ceilings and the MLA
// decode attention kernel (tools/bench/engine).
#include <cstdio>
#include <string>
#include <vector>

#include "bench/common/bench_util.h"
#include "bench/engine/device_engine_bench.h"
#include "bench/engine/engine_bench.h"
#include "cli.h"

namespace pd::cli {

int runBenchEngine(const std::vector<std::string>& args) {
  CommonConfig common;
  CommonOptions common_sets(common);
  bench::EngineBenchConfig cfg;
  std::string isa_name = "auto";
  std::string batches_text;  // empty: 1,4,16,64 on the CPU, 1,8,32,64,128 with --device cuda
  bool json = false;
  bench::DeviceEngineBenchConfig device_cfg;
  config::OptionSet set("bench_engine");
  set.add("model", &cfg.model, "model folder (make one with: pdserve make-model DIR --preset bench [--fp8])")
      .add("threads", &cfg.threads, "compute threads (0: every hardware thread)", 0, 1024)
      .add("isa", &isa_name, "kernel instruction set", {"auto", "avx512", "avx2", "generic"})
      .add("batches", &batches_text, "decode batch sizes, comma-separated (default 1,4,16,64; cuda: 1,8,32,64,128)")
      .add("context", &cfg.context, "cached tokens per sequence during decode", 1, 1 << 20)
      .add("steps", &cfg.steps, "timed decode steps per batch size (after 2 warm-up steps)", 1, 10000)
      .add("prefill_tokens", &cfg.prefill_tokens, "prompt length of the prefill measurement (0: skip)", 0, 1 << 20)
      .add("bandwidth_mb", &cfg.bandwidth_mb, "buffer size of the read-bandwidth probe in MiB", 64, 1 << 20)
      .add("json", &json, "print one JSON object instead of text")
      .add("read_mb", &device_cfg.ceilings.read_mb, "cuda: streaming-read buffer in MiB", 64, 1 << 20)
      .add("gemm_size", &device_cfg.ceilings.gemm_size, "cuda: M = N = K of the BF16 GEMM", 256, 65536)
      .add("iterations", &device_cfg.ceilings.iterations, "cuda: timed repetitions of each measurement", 1, 10000)
      .add("attention_batch", &device_cfg.ceilings.attention_batch, "cuda: sequences of the MLA decode attention", 1,
           1024)
      .add("attention_context", &device_cfg.ceilings.attention_context, "cuda: cached tokens per sequence", 1, 1 << 20);
  auto loaded = loadCommandOptions(
      "usage: pdserve bench engine --model DIR [--threads N] [--batches 1,4,16,64] [--json]\n"
      "       pdserve bench engine --device cuda[:N] [--model DIR] [--json]\n"
      "Decode tokens/s and memory-bandwidth utilization (MBU) per batch size, and prefill tokens/s and FLOP\n"
      "utilization, each as a ratio to a ceiling measured in the same run with the same threads. Use a model whose\n"
      "weights are many times the last-level cache (make-model --preset bench).\n"
      "With --device cuda[:N]: the device's HBM read bandwidth, BF16 GEMM TFLOP/s (cuBLAS) and the MLA decode "
      "attention\n"
      "kernel alone as a fraction of that bandwidth; --model also uploads the checkpoint's weights once and times\n"
      "decode steps through it at each --batches size up to 64 (mbu_batch1, mbu_by_batch; --context cached tokens,\n"
      "--steps steps, --model.numerics) and a --prefill_tokens prompt (prefill_gemm_fraction; docs/gpu.md).",
      {&set, &common_sets.log, &common_sets.model}, args, &common);
  if (!loaded.ok()) return reportFailure(loaded.error());
  if (loaded->help_requested) return 0;
  // --device is model.device (cpu: the CPU engine; cuda[:N]: the device's ceilings).
  auto device = gpu::parseModelDevice(common.model_device);
  if (!device.ok()) return reportFailure(device.error());
  if (device->kind == gpu::ModelDevice::Kind::Cuda) {
    device_cfg.ceilings.device = *device;
    device_cfg.model = cfg.model;  // only an explicit --model is uploaded (and decoded)
    auto numerics = gpu::parseNumerics(common.model_numerics);
    if (!numerics.ok()) return reportFailure(numerics.error());
    device_cfg.numerics = *numerics;
    device_cfg.cuda_graphs = common.cuda_graphs;
    device_cfg.decode_context = cfg.context;
    device_cfg.decode_steps = cfg.steps;
    device_cfg.prefill_tokens = cfg.prefill_tokens;
    if (!batches_text.empty()) {
      auto device_batches = bench::parsePositiveList(batches_text, "--batches");
      if (!device_batches.ok()) return reportFailure(device_batches.error());
      device_cfg.batches = std::move(*device_batches);
    }
    auto measured = bench::runDeviceEngineBench(device_cfg);
    if (!measured.ok()) return reportFailure(measured.error());
    const std::string text = json ? bench::deviceReportJson(*measured) + "\n" : bench::deviceReportText(*measured);
    std::fputs(text.c_str(), stdout);
    return 0;
  }
  auto batches = bench::parsePositiveList(batches_text.empty() ? "1,4,16,64" : batches_text, "--batches");
  if (!batches.ok()) return reportFailure(batches.error());
  cfg.batches = std::move(*batches);
  if (cfg.model.empty()) {
    auto dir = resolveModelDir(common);
    if (!dir.ok()) return reportFailure(dir.error());
    cfg.model = *dir;
  }
  cfg.batch_invariant = common.batch_invariant;
  if (isa_name == "avx512") cfg.isa = model::CpuIsa::Avx512;
  if (isa_name == "avx2") cfg.isa = model::CpuIsa::Avx2;
  if (isa_name == "generic") cfg.isa = model::CpuIsa::Generic;
  auto result = bench::runEngineBench(cfg);
  if (!result.ok()) return reportFailure(result.error());
  const std::string report = json ? bench::engineReportJson(*result) + "\n" : bench::engineReportText(*result);
  std::fputs(report.c_str(), stdout);
  return 0;
}

}  // namespace pd::cli
