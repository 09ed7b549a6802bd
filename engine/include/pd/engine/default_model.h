#pragma once
/// The embedded default model: models/tiny-dsv3 (a small DeepSeek-V3 trained by tools/train/,
/// models/README.md), its files compiled into the binary so that `pdserve up` and friends run
/// with no checkpoint at hand. ensureDefaultModel() (model_factory.h) writes them into the cache.
/// Thread rules: read-only data, any thread.

#include <cstddef>
#include <span>
#include <string_view>

namespace pd {

struct EmbeddedFile {
  std::string_view name;             ///< file name inside the model folder, e.g. "config.json"
  std::span<const std::byte> bytes;  ///< its contents
};

/// config.json, model.safetensors, tokenizer.json, tokenizer_config.json, NOTICE (the training
/// data's licence notices, which must accompany the model).
std::span<const EmbeddedFile> defaultModelFiles();

/// sha256 (hex) of the embedded model.safetensors, computed when the build was configured.
std::string_view defaultModelSha256();

}  // namespace pd
