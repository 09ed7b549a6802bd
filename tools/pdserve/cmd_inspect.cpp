// pdserve inspect MODEL_DIR [--json]: what a checkpoint holds and what serving it costs.
#include <fmt/format.h>

#include <array>
#include <charconv>
#include <cstdio>
#include <map>
#include <string>
#include <string_view>

#include "cli.h"
#include "pd/common/json_text.h"
#include "pd/engine/model_config.h"
#include "pd/engine/safetensors.h"

namespace pd::cli {
namespace {

constexpr std::string_view kActivatedDefinition =
    "bytes one decode step reads for one token: every non-expert weight of the main layers (attention, norms, "
    "dense MLPs, routers, shared experts), num_experts_per_tok of the routed experts per MoE layer, the final norm, "
    "the whole lm_head, and one embedding row; FP8 scales count with their weights. The MTP figure is the same for "
    "one draft step of the MTP layers (their embedding row, eh_proj, block, whole shared_head.head).";

struct DTypeTotals {
  std::int64_t tensors = 0;
  std::int64_t elements = 0;
  std::uint64_t bytes = 0;
};

struct Summary {
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
std::int64_t layerOf(std::string_view name) {
  constexpr std::string_view kPrefix = "model.layers.";
  if (!name.starts_with(kPrefix)) return -1;
  name.remove_prefix(kPrefix.size());
  std::int64_t layer = -1;
  const auto res = std::from_chars(name.data(), name.data() + name.size(), layer);
  return res.ec == std::errc() ? layer : -1;
}

Summary summarize(const ModelConfig& config, const Checkpoint& checkpoint) {
  Summary s;
  const double expert_fraction = config.n_routed_experts > 0 ? static_cast<double>(config.num_experts_per_tok) /
                                                                   static_cast<double>(config.n_routed_experts)
                                                             : 0.0;
  for (const TensorView* t : checkpoint.tensors()) {
    const std::string_view name = t->name;
    const std::int64_t numel = t->numel();
    const auto bytes = static_cast<double>(t->data.size());
    auto& d = s.by_dtype[std::string(dtypeName(t->dtype))];
    d.tensors += 1;
    d.elements += numel;
    d.bytes += t->data.size();

    const bool is_scale = name.ends_with("_scale_inv");
    const std::int64_t layer = layerOf(name);
    const bool is_mtp = layer >= config.num_hidden_layers;
    if (is_scale) {
      s.scale_values += numel;
    } else {
      s.params_total += numel;
      (is_mtp ? s.params_mtp : s.params_main) += numel;
    }

    // What one decode step reads of this tensor.
    double fraction = 1.0;
    if (name.find(".mlp.experts.") != std::string_view::npos) {
      fraction = expert_fraction;
    } else if (name.ends_with("embed_tokens.weight") && config.vocab_size > 0) {
      fraction = 1.0 / static_cast<double>(config.vocab_size);
    }
    (is_mtp ? s.activated_bytes_mtp : s.activated_bytes_main) += bytes * fraction;
    if (!is_mtp && !is_scale) s.activated_params_main += static_cast<double>(numel) * fraction;
  }
  s.kv_bytes_main = config.num_hidden_layers * config.latentDim() * 2;
  s.kv_bytes_with_mtp = config.kvLayers() * config.latentDim() * 2;
  return s;
}

std::string human(double v, std::string_view unit) {
  constexpr std::array<std::string_view, 5> kPrefixes = {"", "K", "M", "G", "T"};
  std::size_t i = 0;
  while (v >= 1000.0 && i + 1 < kPrefixes.size()) {
    v /= 1000.0;
    ++i;
  }
  if (i == 0) return fmt::format("{:.0f}{}{}", v, unit.empty() ? "" : " ", unit);
  return fmt::format("{:.2f} {}{}", v, kPrefixes[i], unit);
}

void printText(const std::filesystem::path& dir, const ModelConfig& c, const Summary& s, std::size_t tensors,
               const Status& valid) {
  const std::int64_t moe_layers = c.num_hidden_layers - c.first_k_dense_replace;
  std::printf("model: %s\n", dir.string().c_str());
  std::printf("  type: %s, %s\n", c.model_type.c_str(),
              c.quantization ? fmt::format("FP8 {} weights, {}x{} block scales", c.quantization->fmt,
                                           c.quantization->block_out, c.quantization->block_in)
                                   .c_str()
                             : "unquantized weights");
  std::printf("  layers: %lld (%lld dense, %lld MoE) + %lld MTP; hidden %lld; vocab %lld; max positions %lld\n",
              static_cast<long long>(c.num_hidden_layers), static_cast<long long>(c.first_k_dense_replace),
              static_cast<long long>(moe_layers), static_cast<long long>(c.num_nextn_predict_layers),
              static_cast<long long>(c.hidden_size), static_cast<long long>(c.vocab_size),
              static_cast<long long>(c.max_position_embeddings));
  std::printf(
      "  attention: MLA, %lld heads, q_lora_rank %s, kv_lora_rank %lld, qk nope/rope %lld/%lld, v %lld, "
      "softmax scale %.17g\n",
      static_cast<long long>(c.num_attention_heads),
      c.q_lora_rank > 0 ? std::to_string(c.q_lora_rank).c_str() : "none (q_proj)",
      static_cast<long long>(c.kv_lora_rank), static_cast<long long>(c.qk_nope_head_dim),
      static_cast<long long>(c.qk_rope_head_dim), static_cast<long long>(c.v_head_dim), c.softmaxScale());
  std::printf(
      "  moe: %lld routed experts (%lld per token, %lld groups, top %lld groups) + %lld shared, width %lld; "
      "dense width %lld; %s/%s, scaling %g\n",
      static_cast<long long>(c.n_routed_experts), static_cast<long long>(c.num_experts_per_tok),
      static_cast<long long>(c.n_group), static_cast<long long>(c.topk_group),
      static_cast<long long>(c.n_shared_experts), static_cast<long long>(c.moe_intermediate_size),
      static_cast<long long>(c.intermediate_size), c.scoring_func.c_str(), c.topk_method.c_str(),
      c.routed_scaling_factor);
  if (c.rope_scaling) {
    std::printf("  rope: theta %g, %s factor %g (original %lld positions)\n", c.rope_theta,
                c.rope_scaling->type.c_str(), c.rope_scaling->factor,
                static_cast<long long>(c.rope_scaling->original_max_position_embeddings));
  } else {
    std::printf("  rope: theta %g, no scaling\n", c.rope_theta);
  }
  std::printf("parameters total: %lld (%s)\n", static_cast<long long>(s.params_total),
              human(static_cast<double>(s.params_total), "").c_str());
  std::printf("parameters main: %lld (%s)\n", static_cast<long long>(s.params_main),
              human(static_cast<double>(s.params_main), "").c_str());
  std::printf("parameters mtp: %lld (%s)\n", static_cast<long long>(s.params_mtp),
              human(static_cast<double>(s.params_mtp), "").c_str());
  if (s.scale_values > 0) {
    std::printf("fp8 scale values: %lld (not counted as parameters)\n", static_cast<long long>(s.scale_values));
  }
  for (const auto& [name, d] : s.by_dtype) {
    std::printf("bytes %s: %llu (%s; %lld tensors, %lld elements)\n", name.c_str(),
                static_cast<unsigned long long>(d.bytes), human(static_cast<double>(d.bytes), "B").c_str(),
                static_cast<long long>(d.tensors), static_cast<long long>(d.elements));
  }
  std::printf("activated bytes per token: %.0f (%s; %.0f parameters)\n", s.activated_bytes_main,
              human(s.activated_bytes_main, "B").c_str(), s.activated_params_main);
  std::printf("activated bytes per mtp draft: %.0f (%s)\n", s.activated_bytes_mtp,
              human(s.activated_bytes_mtp, "B").c_str());
  std::printf("  (%.*s)\n", static_cast<int>(kActivatedDefinition.size()), kActivatedDefinition.data());
  std::printf("latent kv bytes per token: %lld (BF16, %lld main layers x %lld values); %lld with the MTP layers\n",
              static_cast<long long>(s.kv_bytes_main), static_cast<long long>(c.num_hidden_layers),
              static_cast<long long>(c.latentDim()), static_cast<long long>(s.kv_bytes_with_mtp));
  if (valid.ok()) {
    std::printf("tensors: %zu, all match config.json\n", tensors);
  } else {
    std::printf("tensors: %zu, DO NOT match config.json (details on stderr)\n", tensors);
  }
}

void printJson(const std::filesystem::path& dir, const ModelConfig& c, const Summary& s, std::size_t tensors,
               const Status& valid) {
  std::string out = "{\n";
  out += fmt::format("  \"model_dir\": {},\n", jsonString(dir.string()));
  std::string config = c.toJson();
  while (!config.empty() && config.back() == '\n') config.pop_back();
  std::string indented;
  for (const char ch : config) {
    indented += ch;
    if (ch == '\n') indented += "  ";
  }
  out += fmt::format("  \"config\": {},\n", indented);
  out += fmt::format("  \"softmax_scale\": {:.17g},\n", c.softmaxScale());
  out += fmt::format("  \"parameters\": {{\"total\": {}, \"main\": {}, \"mtp\": {}, \"fp8_scale_values\": {}}},\n",
                     s.params_total, s.params_main, s.params_mtp, s.scale_values);
  out += "  \"bytes_by_dtype\": {";
  bool first = true;
  for (const auto& [name, d] : s.by_dtype) {
    out += fmt::format("{}\"{}\": {{\"bytes\": {}, \"tensors\": {}, \"elements\": {}}}", first ? "" : ", ", name,
                       d.bytes, d.tensors, d.elements);
    first = false;
  }
  out += "},\n";
  out += fmt::format(
      "  \"activated_bytes_per_token\": {{\"main\": {:.0f}, \"mtp_draft\": {:.0f}, \"main_parameters\": {:.0f}, "
      "\"definition\": {}}},\n",
      s.activated_bytes_main, s.activated_bytes_mtp, s.activated_params_main, jsonString(kActivatedDefinition));
  out += fmt::format("  \"latent_kv_bytes_per_token\": {{\"main\": {}, \"with_mtp\": {}, \"dtype\": \"BF16\"}},\n",
                     s.kv_bytes_main, s.kv_bytes_with_mtp);
  out += fmt::format("  \"tensors\": {},\n", tensors);
  out += fmt::format("  \"valid\": {}", valid.ok() ? "true" : "false");
  if (!valid.ok()) out += fmt::format(",\n  \"problems\": {}", jsonString(valid.error().message));
  out += "\n}\n";
  std::fputs(out.c_str(), stdout);
}

}  // namespace

int runInspect(const std::vector<std::string>& args) {
  bool as_json = false;
  config::OptionSet set("inspect");
  set.add("json", &as_json, "print one JSON object instead of text");
  auto loaded = loadCommandOptions(
      "usage: pdserve inspect MODEL_DIR [--json]\n"
      "Summarizes a Hugging Face DeepSeek-V3 checkpoint folder: config, parameter counts (main model and MTP),\n"
      "bytes by dtype, activated bytes per decoded token, latent KV bytes per token, and every tensor that is\n"
      "missing, unexpected or mis-shaped for its config.json. Exit status 0 when the checkpoint is valid.",
      {&set}, args);
  if (!loaded.ok()) return reportFailure(loaded.error());
  if (loaded->help_requested) return 0;
  if (loaded->positionals.size() != 1) {
    return reportFailure(makeError(ErrorCode::InvalidArgument, "inspect takes exactly one MODEL_DIR (see --help)"));
  }
  const std::filesystem::path dir = loaded->positionals[0];

  auto config = ModelConfig::load(dir);
  if (!config.ok()) return reportFailure(config.error());
  auto checkpoint = Checkpoint::open(dir);
  if (!checkpoint.ok()) return reportFailure(checkpoint.error());
  const Status valid = validateCheckpoint(config.value(), checkpoint.value());
  const Summary summary = summarize(config.value(), checkpoint.value());
  const std::size_t tensors = checkpoint->tensors().size();
  if (as_json) {
    printJson(dir, config.value(), summary, tensors, valid);
  } else {
    printText(dir, config.value(), summary, tensors, valid);
  }
  std::fflush(stdout);
  return valid.ok() ? 0 : reportFailure(valid.error());
}

}  // namespace pd::cli
