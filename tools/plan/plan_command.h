#pragma once
/// `pdserve plan`'s command logic over the capacity model of planner.h: the flags in the units
/// people type (PlanFlags) into a PlanInput, the calibration file (docs/planner.md,
/// "Calibrating"), and the text and JSON reports.
///
/// Thread rules: pure functions, except that readCalibrationFile reads a file and the run*
/// functions print on stdout (main thread).

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "pd/common/config.h"
#include "pd/common/result.h"
#include "planner.h"

namespace pd::plan {

/// Flag values in the units people type. Hardware fields: < 0 means "the profile's value".
struct PlanFlags {
  std::string model;     ///< preset or checkpoint folder; empty: the calibration file's, else deepseek-v3
  std::string hardware;  ///< profile; empty: the calibration file's, else h200
  double hbm_bandwidth_gbs = -1;
  double hbm_capacity_gb = -1;
  double bf16_tflops = -1;
  double fp8_tflops = -1;
  std::int64_t gpus_per_node = 0;
  double nvlink_bandwidth_gbs = -1;
  double nvlink_latency_us = -1;
  double net_bandwidth_gbs = -1;
  double net_latency_ms = -1;
  double memory_efficiency = -1;
  double compute_efficiency = -1;
  double net_collective_overhead_us = -1;
  double net_latency_hops = -1;

  std::int64_t decode_tp = 0;  ///< 0: the fewest GPUs (a power of two) whose memory holds the weights
  std::int64_t decode_ep = 1;
  std::int64_t decode_dp = 1;
  std::int64_t nodes = 0;  ///< nodes one decode replica spans; 0: ceil(tp / gpus_per_node)
  std::int64_t prefill_tp = 0;
  std::int64_t prefill_ep = 1;
  std::int64_t prefill_dp = 1;
  std::int64_t prefill_nodes = 0;

  std::int64_t input_len = 1024;
  std::int64_t output_len = 256;
  std::int64_t concurrency = 1;
  double request_rate = 0;
  std::int64_t mtp_k = 0;
  double mtp_acceptance = 0.85;
  std::string kv_dtype = "bf16";
  bool kv_streaming = true;
  double ttft_slo_ms = 2000;
  double tpot_slo_ms = 100;

  bool json = false;
  std::filesystem::path calibrate;
};

/// The `plan:` option table, bound to `flags`.
void registerPlanOptions(config::OptionSet& set, PlanFlags& flags);

/// What a calibration file says (docs/planner.md, "Calibrating").
struct CalibrationFile {
  std::string model;
  std::string hardware;
  /// "cuda" for `pdserve bench engine --device cuda --json` (its ceilings, no decode levels yet);
  /// the device it ran on ("cuda:0"); the file's own "note", echoed in every report.
  std::string backend;
  std::string device;
  std::string note;
  double read_bandwidth_gbs = -1;
  double peak_gflops = -1;
  double gemm_bf16_tflops = -1;  ///< the GPU run's dense BF16 GEMM: the BF16 peak (FP8 scaled by the profile)
  std::int64_t tp = 0;
  std::int64_t nodes = 0;
  std::vector<CalibrationPoint> points;
};

/// Reads a calibration file; NotFound when it cannot be opened, InvalidArgument naming the field
/// (and the level) that is missing or wrong.
[[nodiscard]] Result<CalibrationFile> readCalibrationFile(const std::filesystem::path& path);

/// The fewest GPUs, a power of two, whose usable memory holds the weights.
[[nodiscard]] std::int64_t autoTp(const ModelShape& model, const HardwareProfile& hardware);

/// The model's input: the model and hardware named by the flags (else the calibration file's,
/// else deepseek-v3 on h200), the file's measured ceilings and layout, then every flag that
/// overrides a profile value, in SI units. InvalidArgument for an unknown model or hardware.
[[nodiscard]] Result<PlanInput> planInputFromFlags(const PlanFlags& flags, const CalibrationFile* file);

/// The prediction as one JSON object (one line) or as the text report.
[[nodiscard]] std::string planReportJson(const PlanInput& input, const Prediction& prediction);
[[nodiscard]] std::string planReportText(const PlanInput& input, const Prediction& prediction);

/// `pdserve plan`: predicts from the flags and prints the report on stdout.
[[nodiscard]] Result<void> runPlan(const PlanFlags& flags);
/// `pdserve plan --calibrate FILE`: fits the constants to the file and prints predicted vs
/// measured on stdout. A GPU run's file without decode levels (the device engine's decode has not
/// run yet) fits nothing: it prints the hardware profile's ceilings next to the measured ones and
/// the planner's decode predictions under each (docs/planner.md, "The GPU run").
[[nodiscard]] Result<void> runCalibration(const PlanFlags& flags);

}  // namespace pd::plan
