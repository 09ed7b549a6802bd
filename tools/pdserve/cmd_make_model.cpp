// pdserve make-model OUT_DIR: a random-weight checkpoint in the Hugging Face DeepSeek-V3 layout.
#include <fmt/format.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "cli.h"
#include "pd/engine/model_config.h"
#include "pd/engine/model_factory.h"

namespace pd::cli {

int runMakeModel(const std::vector<std::string>& args) {
  std::string preset = "tiny";
  bool fp8 = false;
  std::int64_t seed = 0;
  std::int64_t shard_mb = 1000;
  std::filesystem::path tokenizer;
  bool force = false;
  const std::vector<std::string> dims = dimensionKeys();
  std::vector<std::int64_t> overrides(dims.size(), -1);  // -1: keep the preset's value

  config::OptionSet set("make_model");
  set.add("preset", &preset, "tiny | small | bench | default | deepseek-v3-layers=N (real DeepSeek-V3 sizes, N layers)")
      .add("fp8", &fp8, "store linear weights as F8_E4M3 with 128x128 F32 weight_scale_inv blocks")
      .add("seed", &seed, "random seed; the same seed gives the same bytes", 0, INT64_MAX)
      .add("shard_mb", &shard_mb, "largest shard in MB (1e6 bytes); more than one shard adds the index json", 1,
           1 << 20)
      .add("tokenizer", &tokenizer, "folder whose tokenizer.json / tokenizer_config.json are copied into OUT_DIR")
      .add("force", &force, "replace a model already in OUT_DIR");
  for (std::size_t i = 0; i < dims.size(); ++i) {
    std::string help = "override the preset's " + dims[i] + " (-1: keep";
    help += dims[i] == "q_lora_rank" ? "; 0: a direct q_proj, no q LoRA)" : ")";
    set.add(dims[i], &overrides[i], help, -1, 1 << 24);
  }
  auto loaded = loadCommandOptions(
      "usage: pdserve make-model OUT_DIR [--preset NAME] [--fp8] [--seed N] [--shard-mb N] [--tokenizer DIR]\n"
      "                          [--hidden-size N ...]\n"
      "Writes a random-weight checkpoint in the exact Hugging Face DeepSeek-V3 layout (config.json, safetensors\n"
      "shards + index, the MTP layer) whose activations stay O(1). Deterministic for a seed.",
      {&set}, args);
  if (!loaded.ok()) return reportFailure(loaded.error());
  if (loaded->help_requested) {
    std::printf("\npresets:");
    for (const auto& name : presetNames()) std::printf(" %s", name.c_str());
    std::printf("\n");
    return 0;
  }
  if (loaded->positionals.size() != 1) {
    return reportFailure(makeError(ErrorCode::InvalidArgument, "make-model takes exactly one OUT_DIR (see --help)"));
  }
  const std::filesystem::path out_dir = loaded->positionals[0];

  auto config = presetConfig(preset);
  if (!config.ok()) return reportFailure(config.error());
  for (std::size_t i = 0; i < dims.size(); ++i) {
    if (overrides[i] >= 0) {
      if (auto st = setDimension(config.value(), dims[i], overrides[i]); !st.ok()) return reportFailure(st.error());
    }
  }
  if (fp8) config->quantization = Fp8Quantization{};

  MakeModelOptions options;
  options.seed = static_cast<std::uint64_t>(seed);
  options.max_shard_bytes = static_cast<std::uint64_t>(shard_mb) * 1000 * 1000;
  options.tokenizer_dir = tokenizer;
  options.overwrite = force;
  const auto start = std::chrono::steady_clock::now();
  auto made = makeModel(config.value(), out_dir, options);
  if (!made.ok()) return reportFailure(made.error());
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("wrote %s: preset %s%s, seed %lld, %lld tensors, %.1f MB in %lld shard%s, %.1f s\n",
              out_dir.string().c_str(), preset.c_str(), fp8 ? " fp8" : "", static_cast<long long>(seed),
              static_cast<long long>(made->tensors), static_cast<double>(made->tensor_bytes) / 1e6,
              static_cast<long long>(made->shards), made->shards == 1 ? "" : "s", seconds);
  return 0;
}

}  // namespace pd::cli
