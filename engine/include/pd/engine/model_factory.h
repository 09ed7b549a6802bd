#pragma once
/// Random-weight DeepSeek-V3 checkpoints in the exact Hugging Face layout (what `pdserve
/// make-model` writes), the named presets, and the embedded quick-start model.
///
/// Weights follow golden README 1, so activations stay O(1): linear weights N(0, 1/fan_in)
/// (lm_head and shared_head.head 2.5x that standard deviation), norm weights 1 + N(0, 0.1^2),
/// embeddings N(0, 0.5^2), e_score_correction_bias N(0, 0.05^2) in F32; everything else BF16.
/// The MTP layer's embed_tokens / shared_head.head are bit copies of the main ones.
/// With FP8 (config.quantization set) every quantizable linear is the BF16 value quantized to
/// F8_E4M3 with one F32 scale amax/448 per 128x128 block (round to nearest even, saturating).
///
/// Determinism: each tensor has its own random stream, seeded from (seed, tensor name), drawn by
/// xoshiro256** and Box-Muller, so the bytes depend only on the seed, the config and the libm,
/// never on sharding or on the order of generation.
///
/// Thread rules: free functions, no shared state; makeModel blocks and holds at most one shard
/// of tensor data in memory.

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "pd/common/result.h"
#include "pd/engine/model_config.h"

namespace pd {

/// Preset names for help texts: "tiny", "small", "bench", "default", "deepseek-v3-layers=N".
[[nodiscard]] std::vector<std::string> presetNames();

/// The config of a preset (BF16; set `quantization` for FP8):
///  - tiny: exactly the golden tiny model (hidden 256, 3 layers + 1 MTP, 16 experts, vocab 2048);
///  - small: a few tens of MB (hidden 512, 4 layers + MTP, vocab 4096);
///  - bench: about 1.5 GB in BF16, many times a CPU's last-level cache, for bandwidth benchmarks;
///  - default: the quick-start model: tiny dimensions with the real DeepSeek-V3 vocabulary
///    (129280; bos 0, eos 1) and a 4096-token context;
///  - deepseek-v3-layers=N (1 <= N <= 61): the real DeepSeek-V3 dimensions with N main layers
///    (first_k_dense_replace = min(3, N)) and the MTP layer.
/// InvalidArgument naming the preset when unknown.
Result<ModelConfig> presetConfig(std::string_view preset);

/// config.json keys `setDimension` accepts (integer dimensions such as hidden_size, n_group).
[[nodiscard]] std::vector<std::string> dimensionKeys();

/// Sets one integer dimension by its config.json key. `q_lora_rank` 0 means a direct q_proj.
/// InvalidArgument for an unknown key; the value itself is checked by ModelConfig::validate().
Status setDimension(ModelConfig& config, std::string_view key, std::int64_t value);

struct MakeModelOptions {
  std::uint64_t seed = 0;
  /// Largest shard in bytes; a tensor larger than this gets a shard of its own. One shard is
  /// written as model.safetensors, more as model-0000i-of-0000K.safetensors plus
  /// model.safetensors.index.json.
  std::uint64_t max_shard_bytes = 1000ULL * 1000 * 1000;
  /// When set, tokenizer.json (required) and tokenizer_config.json (if present) are copied from
  /// this folder into the model folder.
  std::filesystem::path tokenizer_dir;
  /// Replace an existing model in out_dir (otherwise a non-empty out_dir is an error).
  bool overwrite = false;
};

struct MakeModelSummary {
  std::int64_t tensors = 0;
  std::int64_t shards = 0;
  std::uint64_t tensor_bytes = 0;  ///< sum of all tensor payloads
};

/// Validates `config`, then writes config.json, the safetensors shard(s) (+ index) and the
/// tokenizer files into `out_dir` (created if absent). Streams: generates and writes one shard
/// at a time. Errors: InvalidArgument (config, non-empty out_dir), NotFound (tokenizer files),
/// Io (writes).
Result<MakeModelSummary> makeModel(const ModelConfig& config, const std::filesystem::path& out_dir,
                                   const MakeModelOptions& options);

/// The embedded quick-start model (default_model.h: models/tiny-dsv3, compiled in): returns
/// `cache_dir/models/default-<first 12 hex of its sha256>`, first writing the embedded files there
/// when absent (a new build with another model gets another folder). Creation is atomic (written
/// in a temporary sibling folder, then renamed), so a concurrent or interrupted run never leaves
/// a half-written model; a racing creator's finished copy is kept. Errors: Io.
Result<std::filesystem::path> ensureDefaultModel(const std::filesystem::path& cache_dir);

}  // namespace pd
