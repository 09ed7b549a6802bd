// The embedded default model's file table (default_model.h); the bytes come from
// default_model.S (configured from default_model.S.in by common/CMakeLists.txt).
#include "pd/engine/default_model.h"

#include <array>

// Symbols defined by default_model.S: the first byte of each file and one past its last.
extern "C" {
extern const std::byte pd_default_model_config_json[];
extern const std::byte pd_default_model_config_json_end[];
extern const std::byte pd_default_model_safetensors[];
extern const std::byte pd_default_model_safetensors_end[];
extern const std::byte pd_default_model_tokenizer_json[];
extern const std::byte pd_default_model_tokenizer_json_end[];
extern const std::byte pd_default_model_tokenizer_config_json[];
extern const std::byte pd_default_model_tokenizer_config_json_end[];
extern const std::byte pd_default_model_notice[];
extern const std::byte pd_default_model_notice_end[];
}

namespace pd {
namespace {

std::span<const std::byte> between(const std::byte* begin, const std::byte* end) {
  return {begin, end};
}

}  // namespace

std::span<const EmbeddedFile> defaultModelFiles() {
  static const std::array<EmbeddedFile, 5> files = {{
      {"config.json", between(pd_default_model_config_json, pd_default_model_config_json_end)},
      {"model.safetensors", between(pd_default_model_safetensors, pd_default_model_safetensors_end)},
      {"tokenizer.json", between(pd_default_model_tokenizer_json, pd_default_model_tokenizer_json_end)},
      {"tokenizer_config.json",
       between(pd_default_model_tokenizer_config_json, pd_default_model_tokenizer_config_json_end)},
      {"NOTICE", between(pd_default_model_notice, pd_default_model_notice_end)},
  }};
  return files;
}

std::string_view defaultModelSha256() {
  return PD_DEFAULT_MODEL_SHA256;
}

}  // namespace pd
