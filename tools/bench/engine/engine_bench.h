#pragma once
/// `pdserve bench engine`: the CPU engine's speed as ratios to ceilings measured in the same run,
/// with the same threads (DESIGN §7):
///  - decode at several batch sizes: bytes a step must read (non-expert weights + the routed
///    experts actually selected + LM head + latent KV, as the engine counts them) / step time,
///    over the read bandwidth of a streaming pass over a buffer far larger than the caches (MBU);
///  - prefill: FLOPs the engine performed / time, over the FMA throughput of a register-only loop.
///
/// Thread rules: runEngineBench() runs on the caller's thread (with the engine's pool); the
/// arithmetic and the reports are pure.

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "pd/common/result.h"
#include "pd/engine/kernels.h"

namespace pd::bench {

struct EngineBenchConfig {
  std::filesystem::path model;  ///< resolved model folder
  std::int64_t threads = 0;     ///< 0: every hardware thread
  std::optional<model::CpuIsa> isa;
  std::vector<std::int64_t> batches{1, 4, 16, 64};
  std::int64_t context = 256;         ///< cached tokens per sequence during decode
  std::int64_t steps = 8;             ///< timed decode steps per batch (after 2 warm-up steps)
  std::int64_t prefill_tokens = 512;  ///< 0: skip the prefill measurement
  std::int64_t bandwidth_mb = 2048;   ///< buffer of the read-bandwidth probe
  bool batch_invariant = false;       ///< model.batch_invariant: CpuEngineOptions::batch_invariant
};

/// One batch size's decode steps.
struct EngineDecodeRow {
  std::int64_t batch = 0;
  double cpu_share = 0.0;     ///< CPU time / (wall time x threads) over the timed steps
  double step_seconds = 0.0;  ///< median
  double bytes_per_step = 0.0;
  double mbu = 0.0;  ///< bytes_per_step / step_seconds / read bandwidth
  std::int64_t experts_per_step = 0;
};

struct EngineBenchResult {
  std::string model;
  std::string weight_dtype;
  std::string backend;
  int threads = 0;
  bool batch_invariant = false;  ///< the engine ran in the batch-invariant mode
  double read_bandwidth = 0.0;   ///< bytes/s, the decode ceiling
  double peak_flops = 0.0;       ///< FLOP/s, the prefill ceiling
  std::int64_t context = 0;
  std::vector<EngineDecodeRow> decode;
  std::int64_t prefill_tokens = 0;
  double prefill_seconds = 0.0;
  double prefill_flops = 0.0;
  double prefill_cpu_share = 0.0;
};

/// Memory-bandwidth utilization: the bytes a step reads over its time, as a fraction of the
/// measured read bandwidth (0 when either is not positive).
[[nodiscard]] double memoryBandwidthUtilization(double bytes_per_step, double step_seconds, double bandwidth);
/// The median of the timed steps (upper middle of an even count); 0 for none.
[[nodiscard]] double medianSeconds(std::vector<double> seconds);
/// The MBU of the batch-1 row; 0 when batch 1 was not measured.
[[nodiscard]] double batchOneMbu(const EngineBenchResult& result);
/// Prefill FLOP/s over the measured peak (0 when not measured).
[[nodiscard]] double prefillFlopsFraction(const EngineBenchResult& result);

/// Measures the two ceilings, then decode at every batch size and prefill once. Errors of the
/// engine end it.
[[nodiscard]] Result<EngineBenchResult> runEngineBench(const EngineBenchConfig& cfg);

/// The report: lines of text, or one JSON object (one line).
[[nodiscard]] std::string engineReportText(const EngineBenchResult& result);
[[nodiscard]] std::string engineReportJson(const EngineBenchResult& result);

}  // namespace pd::bench
