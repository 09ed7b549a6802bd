// pdserve inspect's checkpoint summary (checkpoint_summary.h).
#include "model_tools/checkpoint_summary.h"

#include <fmt/format.h>
#include <fmt/printf.h>

#include <array>
#include <charconv>
#include <string>

#include "pd/common/json_text.h"

namespace pd::tools {
namespace {

constexpr std::string_view kActivatedDefinition =
    "bytes one decode step reads for one token: every non-expert weight of the main layers (attention, norms, "
    "dense MLPs, routers, shared experts), num_experts_per_tok of the routed experts per MoE layer, the final norm, "
    "the whole lm_head, and one embedding row; FP8 scales count with their weights. The MTP figure is the same for "
    "one draft step of the MTP layers (their embedding row, eh_proj, block, whole shared_head.head).";

}  // namespace

std::int64_t layerOf(std::string_view name) {
  constexpr std::string_view kPrefix = "model.layers.";
  if (!name.starts_with(kPrefix)) return -1;
  name.remove_prefix(kPrefix.size());
  std::int64_t layer = -1;
  const auto res = std::from_chars(name.data(), name.data() + name.size(), layer);
  return res.ec == std::errc() ? layer : -1;
}

CheckpointSummary summarizeCheckpoint(const ModelConfig& config, const Checkpoint& checkpoint) {
  CheckpointSummary s;
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

std::string humanQuantity(double v, std::string_view unit) {
  constexpr std::array<std::string_view, 5> kPrefixes = {"", "K", "M", "G", "T"};
  std::size_t i = 0;
  while (v >= 1000.0 && i + 1 < kPrefixes.size()) {
    v /= 1000.0;
    ++i;
  }
  if (i == 0) return fmt::format("{:.0f}{}{}", v, unit.empty() ? "" : " ", unit);
  return fmt::format("{:.2f} {}{}", v, kPrefixes[i], unit);
}

Result<Inspection> inspectCheckpoint(const std::filesystem::path& dir) {
  PD_ASSIGN_OR_RETURN(ModelConfig config, ModelConfig::load(dir));
  PD_ASSIGN_OR_RETURN(Checkpoint checkpoint, Checkpoint::open(dir));
  Inspection in;
  in.dir = dir;
  in.valid = validateCheckpoint(config, checkpoint);
  in.summary = summarizeCheckpoint(config, checkpoint);
  in.tensors = checkpoint.tensors().size();
  in.config = std::move(config);
  return in;
}

std::string inspectionText(const Inspection& in) {
  const std::filesystem::path& dir = in.dir;
  const ModelConfig& c = in.config;
  const CheckpointSummary& s = in.summary;
  const std::size_t tensors = in.tensors;
  const Status& valid = in.valid;
  std::string out;
  const std::int64_t moe_layers = c.num_hidden_layers - c.first_k_dense_replace;
  out += fmt::sprintf("model: %s\n", dir.string().c_str());
  out += fmt::sprintf("  type: %s, %s\n", c.model_type.c_str(),
                      c.quantization ? fmt::format("FP8 {} weights, {}x{} block scales", c.quantization->fmt,
                                                   c.quantization->block_out, c.quantization->block_in)
                                           .c_str()
                                     : "unquantized weights");
  out += fmt::sprintf("  layers: %lld (%lld dense, %lld MoE) + %lld MTP; hidden %lld; vocab %lld; max positions %lld\n",
                      static_cast<long long>(c.num_hidden_layers), static_cast<long long>(c.first_k_dense_replace),
                      static_cast<long long>(moe_layers), static_cast<long long>(c.num_nextn_predict_layers),
                      static_cast<long long>(c.hidden_size), static_cast<long long>(c.vocab_size),
                      static_cast<long long>(c.max_position_embeddings));
  out += fmt::sprintf(
      "  attention: MLA, %lld heads, q_lora_rank %s, kv_lora_rank %lld, qk nope/rope %lld/%lld, v %lld, "
      "softmax scale %.17g\n",
      static_cast<long long>(c.num_attention_heads),
      c.q_lora_rank > 0 ? std::to_string(c.q_lora_rank).c_str() : "none (q_proj)",
      static_cast<long long>(c.kv_lora_rank), static_cast<long long>(c.qk_nope_head_dim),
      static_cast<long long>(c.qk_rope_head_dim), static_cast<long long>(c.v_head_dim), c.softmaxScale());
  out += fmt::sprintf(
      "  moe: %lld routed experts (%lld per token, %lld groups, top %lld groups) + %lld shared, width %lld; "
      "dense width %lld; %s/%s, scaling %g\n",
      static_cast<long long>(c.n_routed_experts), static_cast<long long>(c.num_experts_per_tok),
      static_cast<long long>(c.n_group), static_cast<long long>(c.topk_group),
      static_cast<long long>(c.n_shared_experts), static_cast<long long>(c.moe_intermediate_size),
      static_cast<long long>(c.intermediate_size), c.scoring_func.c_str(), c.topk_method.c_str(),
      c.routed_scaling_factor);
  if (c.rope_scaling) {
    out += fmt::sprintf("  rope: theta %g, %s factor %g (original %lld positions)\n", c.rope_theta,
                        c.rope_scaling->type.c_str(), c.rope_scaling->factor,
                        static_cast<long long>(c.rope_scaling->original_max_position_embeddings));
  } else {
    out += fmt::sprintf("  rope: theta %g, no scaling\n", c.rope_theta);
  }
  out += fmt::sprintf("parameters total: %lld (%s)\n", static_cast<long long>(s.params_total),
                      humanQuantity(static_cast<double>(s.params_total), "").c_str());
  out += fmt::sprintf("parameters main: %lld (%s)\n", static_cast<long long>(s.params_main),
                      humanQuantity(static_cast<double>(s.params_main), "").c_str());
  out += fmt::sprintf("parameters mtp: %lld (%s)\n", static_cast<long long>(s.params_mtp),
                      humanQuantity(static_cast<double>(s.params_mtp), "").c_str());
  if (s.scale_values > 0) {
    out += fmt::sprintf("fp8 scale values: %lld (not counted as parameters)\n", static_cast<long long>(s.scale_values));
  }
  for (const auto& [name, d] : s.by_dtype) {
    out +=
        fmt::sprintf("bytes %s: %llu (%s; %lld tensors, %lld elements)\n", name.c_str(),
                     static_cast<unsigned long long>(d.bytes), humanQuantity(static_cast<double>(d.bytes), "B").c_str(),
                     static_cast<long long>(d.tensors), static_cast<long long>(d.elements));
  }
  out += fmt::sprintf("activated bytes per token: %.0f (%s; %.0f parameters)\n", s.activated_bytes_main,
                      humanQuantity(s.activated_bytes_main, "B").c_str(), s.activated_params_main);
  out += fmt::sprintf("activated bytes per mtp draft: %.0f (%s)\n", s.activated_bytes_mtp,
                      humanQuantity(s.activated_bytes_mtp, "B").c_str());
  out += fmt::sprintf("  (%.*s)\n", static_cast<int>(kActivatedDefinition.size()), kActivatedDefinition.data());
  out +=
      fmt::sprintf("latent kv bytes per token: %lld (BF16, %lld main layers x %lld values); %lld with the MTP layers\n",
                   static_cast<long long>(s.kv_bytes_main), static_cast<long long>(c.num_hidden_layers),
                   static_cast<long long>(c.latentDim()), static_cast<long long>(s.kv_bytes_with_mtp));
  if (valid.ok()) {
    out += fmt::sprintf("tensors: %zu, all match config.json\n", tensors);
  } else {
    out += fmt::sprintf("tensors: %zu, DO NOT match config.json (details on stderr)\n", tensors);
  }
  return out;
}

std::string inspectionJson(const Inspection& in) {
  const std::filesystem::path& dir = in.dir;
  const ModelConfig& c = in.config;
  const CheckpointSummary& s = in.summary;
  const std::size_t tensors = in.tensors;
  const Status& valid = in.valid;
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
  return out;
}

}  // namespace pd::tools
