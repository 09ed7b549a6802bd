#pragma once
/// What a checkpoint holds and what serving it costs, behind `pdserve inspect`: parameter counts
/// (main model and MTP), bytes by dtype, activated bytes per decoded token, latent KV bytes per
/// token, and whether every tensor matches config.json.
///
/// Thread rules: pure functions, except inspectCheckpoint, which reads the folder.

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <string_view>

#include "pd/common/result.h"
#include "pd/engine/model_config.h"
#include "pd/engine/safetensors.h"

namespace pd::tools {

struct DTypeTotals {
  std::int64_t tensors = 0;
  std::int64_t elements = 0;
  std::uint64_t bytes = 0;
};

struct CheckpointSummary {
  std::int64_t params_total = 0;
  std::int64_t params_main = 0;
  std::int64_t params_mtp = 0;
  std::int64_t scale_values = 0;  ///< FP8 weight_scale_inv elements, not counted as parameters
  std::map<std::string, DTypeTotals> by_dtype;
  double activated_bytes_main = 0;
  double activated_bytes_mtp = 0;
  double activated_params_main = 0;
  std::int64_t kv_bytes_main = 0;      ///< BF16 latent KV per token over the main layers
  std::int64_t kv_bytes_with_mtp = 0;  ///< ... plus the MTP layers' own latent KV
};

/// The layer index of "model.layers.<L>.*", or -1.
[[nodiscard]] std::int64_t layerOf(std::string_view tensor_name);

/// Counts every tensor of `checkpoint`. Activated bytes: every non-expert weight of the main
/// layers, num_experts_per_tok / n_routed_experts of the routed experts, one embedding row; the
/// MTP layers' share separately.
[[nodiscard]] CheckpointSummary summarizeCheckpoint(const ModelConfig& config, const Checkpoint& checkpoint);

/// A checkpoint folder read and checked.
struct Inspection {
  std::filesystem::path dir;
  ModelConfig config;
  CheckpointSummary summary;
  std::size_t tensors = 0;
  Status valid;  ///< validateCheckpoint's verdict
};

/// Loads config.json and the safetensors of `dir` and summarizes them; errors when either cannot
/// be read (a checkpoint that reads but does not match its config is an Inspection with !valid).
[[nodiscard]] Result<Inspection> inspectCheckpoint(const std::filesystem::path& dir);

/// The report: lines of text, or one JSON object.
[[nodiscard]] std::string inspectionText(const Inspection& inspection);
[[nodiscard]] std::string inspectionJson(const Inspection& inspection);

/// 1234567 -> "1.23 M" (+ unit), below 1000 without a prefix.
[[nodiscard]] std::string humanQuantity(double value, std::string_view unit);

}  // namespace pd::tools
