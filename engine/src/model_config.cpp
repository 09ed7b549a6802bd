#include "pd/engine/model_config.h"

#include <fmt/format.h>

#include <algorithm>
#include <boost/json.hpp>
#include <charconv>
#include <cmath>
#include <fstream>
#include <map>
#include <sstream>
#include <system_error>

namespace pd {
namespace {

namespace json = boost::json;

/// Upper bound on any dimension: keeps every shape product far from int64 overflow.
constexpr std::int64_t kMaxDim = std::int64_t{1} << 24;

std::string joinProblems(const std::vector<std::string>& problems) {
  std::string out;
  for (const auto& p : problems) {
    out += "\n  ";
    out += p;
  }
  return out;
}

/// Reads typed values out of one JSON object, collecting every problem instead of stopping at
/// the first. `prefix` ("rope_scaling.") qualifies key names in messages.
class KeyReader {
 public:
  KeyReader(const json::object& object, std::string prefix, std::vector<std::string>* problems)
      : object_(object), prefix_(std::move(prefix)), problems_(problems) {}

  /// nullptr when the key is absent or null.
  [[nodiscard]] const json::value* find(std::string_view key) const {
    const json::value* v = object_.if_contains(key);
    if (v == nullptr || v->is_null()) return nullptr;
    return v;
  }
  [[nodiscard]] bool present(std::string_view key) const { return object_.contains(key); }

  void problem(std::string_view key, std::string_view what) const {
    problems_->push_back(fmt::format("'{}{}': {}", prefix_, key, what));
  }

  void integer(std::string_view key, std::int64_t* out, bool required) const {
    const json::value* v = find(key);
    if (v == nullptr) {
      if (required) problem(key, "required key is missing");
      return;
    }
    if (v->is_int64()) {
      *out = v->get_int64();
    } else if (v->is_uint64() && v->get_uint64() <= static_cast<std::uint64_t>(kMaxDim)) {
      *out = static_cast<std::int64_t>(v->get_uint64());
    } else if (v->is_double() && std::isfinite(v->get_double()) && std::fabs(v->get_double()) < 9.0e15 &&
               std::floor(v->get_double()) == v->get_double()) {
      *out = static_cast<std::int64_t>(v->get_double());  // 4096.0 is an integer too
    } else {
      problem(key, fmt::format("expected an integer, got {}", json::serialize(*v)));
    }
  }

  void number(std::string_view key, double* out, bool required) const {
    const json::value* v = find(key);
    if (v == nullptr) {
      if (required) problem(key, "required key is missing");
      return;
    }
    if (v->is_number()) {
      *out = v->to_number<double>();
    } else {
      problem(key, fmt::format("expected a number, got {}", json::serialize(*v)));
    }
  }

  void boolean(std::string_view key, bool* out) const {
    const json::value* v = find(key);
    if (v == nullptr) return;
    if (v->is_bool()) {
      *out = v->get_bool();
    } else {
      problem(key, fmt::format("expected true or false, got {}", json::serialize(*v)));
    }
  }

  void string(std::string_view key, std::string* out, bool required) const {
    const json::value* v = find(key);
    if (v == nullptr) {
      if (required) problem(key, "required key is missing");
      return;
    }
    if (v->is_string()) {
      *out = std::string(v->get_string());
    } else {
      problem(key, fmt::format("expected a string, got {}", json::serialize(*v)));
    }
  }

 private:
  const json::object& object_;
  std::string prefix_;
  std::vector<std::string>* problems_;
};

void parseRopeScaling(const json::value& value, std::optional<RopeScaling>* out, std::vector<std::string>* problems) {
  if (value.is_null()) return;
  if (!value.is_object()) {
    problems->push_back(fmt::format("'rope_scaling': expected an object or null, got {}", json::serialize(value)));
    return;
  }
  const KeyReader r(value.get_object(), "rope_scaling.", problems);
  RopeScaling rs;
  rs.mscale_all_dim = 0.0;  // Hugging Face's default when the key is absent
  // Newer Hugging Face configs spell the kind "rope_type"; either is accepted.
  if (r.find("type") != nullptr) {
    r.string("type", &rs.type, true);
  } else {
    r.string("rope_type", &rs.type, false);
    if (r.find("rope_type") == nullptr) r.problem("type", "required key is missing");
  }
  r.number("factor", &rs.factor, true);
  r.integer("original_max_position_embeddings", &rs.original_max_position_embeddings, true);
  r.number("beta_fast", &rs.beta_fast, false);
  r.number("beta_slow", &rs.beta_slow, false);
  r.number("mscale", &rs.mscale, false);
  r.number("mscale_all_dim", &rs.mscale_all_dim, false);
  *out = rs;
}

void parseQuantization(const json::value& value, std::optional<Fp8Quantization>* out,
                       std::vector<std::string>* problems) {
  if (value.is_null()) return;
  if (!value.is_object()) {
    problems->push_back(
        fmt::format("'quantization_config': expected an object or null, got {}", json::serialize(value)));
    return;
  }
  const KeyReader r(value.get_object(), "quantization_config.", problems);
  std::string method;
  r.string("quant_method", &method, true);
  if (!method.empty() && method != "fp8") {
    r.problem("quant_method", fmt::format("'{}' is not supported (only fp8 block quantization)", method));
  }
  Fp8Quantization q;
  r.string("fmt", &q.fmt, false);
  r.string("activation_scheme", &q.activation_scheme, false);
  const json::value* block = r.find("weight_block_size");
  if (block == nullptr) {
    r.problem("weight_block_size", "required key is missing (per-tensor FP8 is not supported)");
  } else if (!block->is_array() || block->get_array().size() != 2 || !block->get_array()[0].is_int64() ||
             !block->get_array()[1].is_int64()) {
    r.problem("weight_block_size", fmt::format("expected [rows, columns], got {}", json::serialize(*block)));
  } else {
    q.block_out = block->get_array()[0].get_int64();
    q.block_in = block->get_array()[1].get_int64();
  }
  *out = q;
}

/// Collects the consistency problems of a config (shared by fromJson and validate()).
std::vector<std::string> findProblems(const ModelConfig& c) {
  std::vector<std::string> problems;
  auto bad = [&](std::string_view key, const std::string& what) {
    problems.push_back(fmt::format("'{}': {}", key, what));
  };
  auto positive = [&](std::string_view key, std::int64_t v) {
    if (v <= 0 || v > kMaxDim) bad(key, fmt::format("must be in 1..{}, got {}", kMaxDim, v));
  };
  auto non_negative = [&](std::string_view key, std::int64_t v) {
    if (v < 0 || v > kMaxDim) bad(key, fmt::format("must be in 0..{}, got {}", kMaxDim, v));
  };

  if (c.model_type != "deepseek_v3" && c.model_type != "deepseek_v2") {
    bad("model_type",
        fmt::format("'{}' is not a DeepSeek-V3 architecture (expected deepseek_v3 or deepseek_v2)", c.model_type));
  }
  positive("vocab_size", c.vocab_size);
  positive("hidden_size", c.hidden_size);
  positive("intermediate_size", c.intermediate_size);
  positive("moe_intermediate_size", c.moe_intermediate_size);
  positive("num_hidden_layers", c.num_hidden_layers);
  positive("num_attention_heads", c.num_attention_heads);
  non_negative("q_lora_rank", c.q_lora_rank);
  positive("kv_lora_rank", c.kv_lora_rank);
  positive("qk_nope_head_dim", c.qk_nope_head_dim);
  positive("qk_rope_head_dim", c.qk_rope_head_dim);
  if (c.qk_rope_head_dim % 2 != 0) {
    bad("qk_rope_head_dim", fmt::format("must be even (RoPE rotates pairs), got {}", c.qk_rope_head_dim));
  }
  positive("v_head_dim", c.v_head_dim);
  positive("max_position_embeddings", c.max_position_embeddings);
  positive("moe_layer_freq", c.moe_layer_freq);
  non_negative("n_shared_experts", c.n_shared_experts);
  non_negative("num_nextn_predict_layers", c.num_nextn_predict_layers);
  if (c.first_k_dense_replace < 0 || c.first_k_dense_replace > c.num_hidden_layers) {
    bad("first_k_dense_replace",
        fmt::format("must be in 0..num_hidden_layers ({}), got {}", c.num_hidden_layers, c.first_k_dense_replace));
  }

  positive("n_routed_experts", c.n_routed_experts);
  positive("n_group", c.n_group);
  if (c.n_routed_experts > 0 && c.n_group > 0) {
    if (c.n_routed_experts % c.n_group != 0) {
      bad("n_group",
          fmt::format("n_routed_experts ({}) must be divisible by n_group ({})", c.n_routed_experts, c.n_group));
    } else if (c.topk_method == "noaux_tc" && c.n_group > 1 && c.n_routed_experts / c.n_group < 2) {
      bad("n_group", fmt::format("noaux_tc scores a group by its top-2 experts, so each of the {} groups needs at "
                                 "least 2 of the {} experts",
                                 c.n_group, c.n_routed_experts));
    }
  }
  if (c.topk_group < 1 || c.topk_group > c.n_group) {
    bad("topk_group", fmt::format("must be in 1..n_group ({}), got {}", c.n_group, c.topk_group));
  }
  if (c.num_experts_per_tok < 1) {
    bad("num_experts_per_tok", fmt::format("must be at least 1, got {}", c.num_experts_per_tok));
  } else if (c.n_group > 0 && c.n_routed_experts > 0 && c.topk_group >= 1 && c.topk_group <= c.n_group &&
             c.num_experts_per_tok > c.topk_group * (c.n_routed_experts / c.n_group)) {
    bad("num_experts_per_tok",
        fmt::format("{} exceeds the {} experts in topk_group ({}) groups of n_routed_experts/n_group ({})",
                    c.num_experts_per_tok, c.topk_group * (c.n_routed_experts / c.n_group), c.topk_group,
                    c.n_routed_experts / c.n_group));
  }
  if (c.scoring_func != "sigmoid" && c.scoring_func != "softmax") {
    bad("scoring_func", fmt::format("'{}' is not one of: sigmoid, softmax", c.scoring_func));
  }
  if (c.topk_method != "noaux_tc" && c.topk_method != "greedy" && c.topk_method != "group_limited_greedy") {
    bad("topk_method", fmt::format("'{}' is not one of: noaux_tc, greedy, group_limited_greedy", c.topk_method));
  }
  if (!(c.routed_scaling_factor > 0.0) || !std::isfinite(c.routed_scaling_factor)) {
    bad("routed_scaling_factor", fmt::format("must be positive, got {}", c.routed_scaling_factor));
  }
  if (!(c.rms_norm_eps > 0.0) || !(c.rms_norm_eps < 1.0)) {
    bad("rms_norm_eps", fmt::format("must be in (0, 1), got {}", c.rms_norm_eps));
  }
  if (!(c.rope_theta > 0.0) || !std::isfinite(c.rope_theta)) {
    bad("rope_theta", fmt::format("must be positive, got {}", c.rope_theta));
  }
  if (c.vocab_size > 0) {
    if (c.bos_token_id < 0 || c.bos_token_id >= c.vocab_size) {
      bad("bos_token_id", fmt::format("must be in 0..vocab_size-1 ({}), got {}", c.vocab_size - 1, c.bos_token_id));
    }
    if (c.eos_token_id < 0 || c.eos_token_id >= c.vocab_size) {
      bad("eos_token_id", fmt::format("must be in 0..vocab_size-1 ({}), got {}", c.vocab_size - 1, c.eos_token_id));
    }
  }
  if (c.rope_scaling) {
    const RopeScaling& rs = *c.rope_scaling;
    if (rs.type != "yarn") {
      bad("rope_scaling.type", fmt::format("'{}' is not supported (only yarn)", rs.type));
    }
    if (!(rs.factor > 0.0) || !std::isfinite(rs.factor)) {
      bad("rope_scaling.factor", fmt::format("must be positive, got {}", rs.factor));
    }
    if (rs.original_max_position_embeddings <= 0 || rs.original_max_position_embeddings > (std::int64_t{1} << 30)) {
      bad("rope_scaling.original_max_position_embeddings",
          fmt::format("must be positive, got {}", rs.original_max_position_embeddings));
    }
    if (!(rs.beta_fast > 0.0) || !(rs.beta_slow > 0.0) || !(rs.beta_fast >= rs.beta_slow)) {
      bad("rope_scaling.beta_fast", fmt::format("need beta_fast >= beta_slow > 0, got beta_fast {} and beta_slow {}",
                                                rs.beta_fast, rs.beta_slow));
    }
    if (!(rs.mscale >= 0.0) || !(rs.mscale_all_dim >= 0.0)) {
      bad("rope_scaling.mscale",
          fmt::format("mscale ({}) and mscale_all_dim ({}) must be non-negative", rs.mscale, rs.mscale_all_dim));
    }
  }
  if (c.quantization) {
    const Fp8Quantization& q = *c.quantization;
    if (q.fmt != "e4m3") {
      bad("quantization_config.fmt", fmt::format("'{}' is not supported (only e4m3)", q.fmt));
    }
    if (q.activation_scheme != "dynamic") {
      bad("quantization_config.activation_scheme",
          fmt::format("'{}' is not supported (only dynamic)", q.activation_scheme));
    }
    if (q.block_out <= 0 || q.block_in <= 0 || q.block_out > kMaxDim || q.block_in > kMaxDim) {
      bad("quantization_config.weight_block_size",
          fmt::format("block sizes must be positive, got [{}, {}]", q.block_out, q.block_in));
    }
  }
  return problems;
}

// ---- JSON writing: pretty-printed, keys in the order of the real DeepSeek-V3 config. ----

std::string formatDouble(double v) {
  if (std::floor(v) == v && std::fabs(v) < 1e15) return fmt::format("{:.1f}", v);
  char buf[64];
  const auto res = std::to_chars(buf, buf + sizeof(buf), v);  // shortest text that round-trips
  return std::string(buf, res.ptr);
}

void writeValue(const json::value& v, int indent, std::string* out) {
  const std::string pad(static_cast<std::size_t>(indent + 2), ' ');
  switch (v.kind()) {
    case json::kind::object: {
      const auto& o = v.get_object();
      if (o.empty()) {
        *out += "{}";
        return;
      }
      *out += "{\n";
      bool first = true;
      for (const auto& kv : o) {
        if (!first) *out += ",\n";
        first = false;
        *out += pad;
        *out += json::serialize(json::value(kv.key()));
        *out += ": ";
        writeValue(kv.value(), indent + 2, out);
      }
      *out += "\n" + std::string(static_cast<std::size_t>(indent), ' ') + "}";
      return;
    }
    case json::kind::array: {
      const auto& a = v.get_array();
      *out += "[";
      for (std::size_t i = 0; i < a.size(); ++i) {
        if (i > 0) *out += ", ";
        writeValue(a[i], indent + 2, out);
      }
      *out += "]";
      return;
    }
    case json::kind::double_:
      *out += formatDouble(v.get_double());
      return;
    default:
      *out += json::serialize(v);
      return;
  }
}

std::int64_t ceilDiv(std::int64_t a, std::int64_t b) {
  return (a + b - 1) / b;
}

}  // namespace

Result<ModelConfig> ModelConfig::fromJson(std::string_view json_text, const std::string& source) {
  boost::system::error_code ec;
  const json::value root = json::parse(json_text, ec);
  if (ec) {
    return makeError(ErrorCode::InvalidArgument, fmt::format("{}: not valid JSON: {}", source, ec.message()));
  }
  if (!root.is_object()) {
    return makeError(ErrorCode::InvalidArgument, fmt::format("{}: expected a JSON object at the top level", source));
  }
  std::vector<std::string> problems;
  const KeyReader r(root.get_object(), "", &problems);
  ModelConfig c;
  r.string("model_type", &c.model_type, true);
  r.integer("vocab_size", &c.vocab_size, true);
  r.integer("hidden_size", &c.hidden_size, true);
  r.integer("intermediate_size", &c.intermediate_size, true);
  r.integer("moe_intermediate_size", &c.moe_intermediate_size, true);
  r.integer("num_hidden_layers", &c.num_hidden_layers, true);
  r.integer("first_k_dense_replace", &c.first_k_dense_replace, false);
  r.integer("moe_layer_freq", &c.moe_layer_freq, false);
  r.integer("num_attention_heads", &c.num_attention_heads, true);
  // q_lora_rank must be present; null (deepseek_v2 style) means a direct q_proj.
  if (!r.present("q_lora_rank")) {
    r.problem("q_lora_rank", "required key is missing (use null for a direct q_proj)");
  } else {
    r.integer("q_lora_rank", &c.q_lora_rank, false);
  }
  r.integer("kv_lora_rank", &c.kv_lora_rank, true);
  r.integer("qk_nope_head_dim", &c.qk_nope_head_dim, true);
  r.integer("qk_rope_head_dim", &c.qk_rope_head_dim, true);
  r.integer("v_head_dim", &c.v_head_dim, true);
  r.integer("n_routed_experts", &c.n_routed_experts, true);
  r.integer("num_experts_per_tok", &c.num_experts_per_tok, true);
  r.integer("n_group", &c.n_group, false);
  r.integer("topk_group", &c.topk_group, false);
  r.integer("n_shared_experts", &c.n_shared_experts, false);
  r.number("routed_scaling_factor", &c.routed_scaling_factor, false);
  r.string("scoring_func", &c.scoring_func, false);
  r.string("topk_method", &c.topk_method, false);
  r.boolean("norm_topk_prob", &c.norm_topk_prob);
  r.number("rms_norm_eps", &c.rms_norm_eps, false);
  r.number("rope_theta", &c.rope_theta, false);
  r.integer("max_position_embeddings", &c.max_position_embeddings, true);
  if (const json::value* v = root.get_object().if_contains("rope_scaling")) {
    parseRopeScaling(*v, &c.rope_scaling, &problems);
  }
  if (const json::value* v = root.get_object().if_contains("quantization_config")) {
    parseQuantization(*v, &c.quantization, &problems);
  }
  r.integer("num_nextn_predict_layers", &c.num_nextn_predict_layers, false);
  r.integer("bos_token_id", &c.bos_token_id, false);
  r.integer("eos_token_id", &c.eos_token_id, false);
  r.boolean("tie_word_embeddings", &c.tie_word_embeddings);
  if (const json::value* v = r.find("num_key_value_heads")) {
    // MLA has no grouped KV heads: Hugging Face configs repeat num_attention_heads here.
    if (!v->is_int64() || (c.num_attention_heads > 0 && v->get_int64() != c.num_attention_heads)) {
      r.problem("num_key_value_heads", fmt::format("must equal num_attention_heads ({}) for MLA, got {}",
                                                   c.num_attention_heads, json::serialize(*v)));
    }
  }

  // Consistency rules too, except for keys that already failed to parse (their value is a
  // default, so a second message about it would mislead).
  auto key_of = [](const std::string& problem) { return problem.substr(0, problem.find("': ") + 1); };
  const std::size_t parse_problems = problems.size();
  for (auto& p : findProblems(c)) {
    bool seen = false;
    for (std::size_t i = 0; i < parse_problems; ++i) seen = seen || key_of(problems[i]) == key_of(p);
    if (!seen) problems.push_back(std::move(p));
  }
  if (!problems.empty()) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("{}: invalid model config ({} problem{}):{}", source, problems.size(),
                                 problems.size() == 1 ? "" : "s", joinProblems(problems)));
  }
  return c;
}

Result<ModelConfig> ModelConfig::load(const std::filesystem::path& dir) {
  const std::filesystem::path path = dir / "config.json";
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) {
    return makeError(ErrorCode::NotFound,
                     fmt::format("{}: no such file (a model folder needs config.json)", path.string()));
  }
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  if (!in.good() && !in.eof()) {
    return makeError(ErrorCode::Io, fmt::format("{}: read failed", path.string()));
  }
  return fromJson(text.str(), path.string());
}

Status ModelConfig::validate() const {
  const std::vector<std::string> problems = findProblems(*this);
  if (problems.empty()) return okStatus();
  return makeError(ErrorCode::InvalidArgument, fmt::format("invalid model config ({} problem{}):{}", problems.size(),
                                                           problems.size() == 1 ? "" : "s", joinProblems(problems)));
}

std::string ModelConfig::toJson() const {
  json::object o;
  o["architectures"] = json::array{model_type == "deepseek_v2" ? "DeepseekV2ForCausalLM" : "DeepseekV3ForCausalLM"};
  o["model_type"] = model_type;
  o["vocab_size"] = vocab_size;
  o["hidden_size"] = hidden_size;
  o["intermediate_size"] = intermediate_size;
  o["moe_intermediate_size"] = moe_intermediate_size;
  o["num_hidden_layers"] = num_hidden_layers;
  o["num_nextn_predict_layers"] = num_nextn_predict_layers;
  o["first_k_dense_replace"] = first_k_dense_replace;
  o["moe_layer_freq"] = moe_layer_freq;
  o["num_attention_heads"] = num_attention_heads;
  o["num_key_value_heads"] = num_attention_heads;
  o["q_lora_rank"] = q_lora_rank > 0 ? json::value(q_lora_rank) : json::value(nullptr);
  o["kv_lora_rank"] = kv_lora_rank;
  o["qk_nope_head_dim"] = qk_nope_head_dim;
  o["qk_rope_head_dim"] = qk_rope_head_dim;
  o["v_head_dim"] = v_head_dim;
  o["n_routed_experts"] = n_routed_experts;
  o["num_experts_per_tok"] = num_experts_per_tok;
  o["n_group"] = n_group;
  o["topk_group"] = topk_group;
  o["n_shared_experts"] = n_shared_experts;
  o["routed_scaling_factor"] = routed_scaling_factor;
  o["scoring_func"] = scoring_func;
  o["topk_method"] = topk_method;
  o["norm_topk_prob"] = norm_topk_prob;
  o["hidden_act"] = "silu";
  o["rms_norm_eps"] = rms_norm_eps;
  o["rope_theta"] = rope_theta;
  o["max_position_embeddings"] = max_position_embeddings;
  if (rope_scaling) {
    json::object rs;
    rs["type"] = rope_scaling->type;
    rs["factor"] = rope_scaling->factor;
    rs["original_max_position_embeddings"] = rope_scaling->original_max_position_embeddings;
    rs["beta_fast"] = rope_scaling->beta_fast;
    rs["beta_slow"] = rope_scaling->beta_slow;
    rs["mscale"] = rope_scaling->mscale;
    rs["mscale_all_dim"] = rope_scaling->mscale_all_dim;
    o["rope_scaling"] = std::move(rs);
  } else {
    o["rope_scaling"] = nullptr;
  }
  o["attention_bias"] = false;
  o["attention_dropout"] = 0.0;
  o["bos_token_id"] = bos_token_id;
  o["eos_token_id"] = eos_token_id;
  o["tie_word_embeddings"] = tie_word_embeddings;
  o["torch_dtype"] = "bfloat16";
  o["use_cache"] = true;
  if (quantization) {
    json::object q;
    q["quant_method"] = "fp8";
    q["fmt"] = quantization->fmt;
    q["activation_scheme"] = quantization->activation_scheme;
    q["weight_block_size"] = json::array{quantization->block_out, quantization->block_in};
    o["quantization_config"] = std::move(q);
  }
  std::string out;
  writeValue(o, 0, &out);
  out += "\n";
  return out;
}

bool ModelConfig::isMoeLayer(std::int64_t layer) const {
  return n_routed_experts > 0 && layer >= first_k_dense_replace && moe_layer_freq > 0 && layer % moe_layer_freq == 0;
}

double ModelConfig::softmaxScale() const {
  // Same operations in the same order as the reference (`qk_head_dim ** -0.5 * m * m`), so the
  // double matches its printed value to the last bit.
  double scale = std::pow(static_cast<double>(qkHeadDim()), -0.5);
  if (rope_scaling && rope_scaling->type == "yarn" && rope_scaling->factor > 1.0) {
    const double m = 0.1 * rope_scaling->mscale_all_dim * std::log(rope_scaling->factor) + 1.0;
    scale = scale * m * m;
  }
  return scale;
}

std::vector<TensorSpec> expectedTensors(const ModelConfig& c) {
  std::vector<TensorSpec> specs;
  const std::int64_t d = c.hidden_size;
  auto plain = [&](std::string name, std::vector<std::int64_t> shape, DType dtype = DType::BF16) {
    specs.push_back(TensorSpec{std::move(name), std::move(shape), dtype, false, false});
  };
  // A linear weight [out, in] that FP8 checkpoints quantize, followed by its scale.
  auto linear = [&](const std::string& name, std::int64_t out, std::int64_t in) {
    if (!c.quantization) {
      specs.push_back(TensorSpec{name, {out, in}, DType::BF16, true, false});
      return;
    }
    specs.push_back(TensorSpec{name, {out, in}, DType::F8E4M3, true, false});
    specs.push_back(TensorSpec{name + "_scale_inv",
                               {ceilDiv(out, c.quantization->block_out), ceilDiv(in, c.quantization->block_in)},
                               DType::F32,
                               false,
                               true});
  };
  auto mlp = [&](const std::string& prefix, std::int64_t width) {
    linear(prefix + "gate_proj.weight", width, d);
    linear(prefix + "up_proj.weight", width, d);
    linear(prefix + "down_proj.weight", d, width);
  };
  auto decoder_layer = [&](std::int64_t layer) {
    const std::string p = fmt::format("model.layers.{}.", layer);
    const std::int64_t h = c.num_attention_heads;
    plain(p + "input_layernorm.weight", {d});
    if (c.q_lora_rank > 0) {
      linear(p + "self_attn.q_a_proj.weight", c.q_lora_rank, d);
      plain(p + "self_attn.q_a_layernorm.weight", {c.q_lora_rank});
      linear(p + "self_attn.q_b_proj.weight", h * c.qkHeadDim(), c.q_lora_rank);
    } else {
      linear(p + "self_attn.q_proj.weight", h * c.qkHeadDim(), d);
    }
    linear(p + "self_attn.kv_a_proj_with_mqa.weight", c.kv_lora_rank + c.qk_rope_head_dim, d);
    plain(p + "self_attn.kv_a_layernorm.weight", {c.kv_lora_rank});
    linear(p + "self_attn.kv_b_proj.weight", h * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank);
    linear(p + "self_attn.o_proj.weight", d, h * c.v_head_dim);
    plain(p + "post_attention_layernorm.weight", {d});
    if (!c.isMoeLayer(layer)) {
      mlp(p + "mlp.", c.intermediate_size);
      return;
    }
    plain(p + "mlp.gate.weight", {c.n_routed_experts, d});
    if (c.topk_method == "noaux_tc") plain(p + "mlp.gate.e_score_correction_bias", {c.n_routed_experts}, DType::F32);
    for (std::int64_t e = 0; e < c.n_routed_experts; ++e)
      mlp(fmt::format("{}mlp.experts.{}.", p, e), c.moe_intermediate_size);
    if (c.n_shared_experts > 0) mlp(p + "mlp.shared_experts.", c.moe_intermediate_size * c.n_shared_experts);
  };

  plain("model.embed_tokens.weight", {c.vocab_size, d});
  for (std::int64_t layer = 0; layer < c.num_hidden_layers; ++layer) decoder_layer(layer);
  plain("model.norm.weight", {d});
  if (!c.tie_word_embeddings) plain("lm_head.weight", {c.vocab_size, d});
  for (std::int64_t k = 0; k < c.num_nextn_predict_layers; ++k) {
    const std::int64_t layer = c.num_hidden_layers + k;
    const std::string p = fmt::format("model.layers.{}.", layer);
    plain(p + "embed_tokens.weight", {c.vocab_size, d});
    plain(p + "enorm.weight", {d});
    plain(p + "hnorm.weight", {d});
    plain(p + "eh_proj.weight", {d, 2 * d});
    decoder_layer(layer);
    plain(p + "shared_head.norm.weight", {d});
    plain(p + "shared_head.head.weight", {c.vocab_size, d});
  }
  return specs;
}

namespace {

std::string shapeText(const std::vector<std::int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

bool isFloatDType(DType t) {
  return t == DType::BF16 || t == DType::F16 || t == DType::F32;
}

}  // namespace

Status validateCheckpoint(const ModelConfig& config, const Checkpoint& checkpoint) {
  const std::vector<TensorSpec> specs = expectedTensors(config);
  std::map<std::string_view, const TensorSpec*> by_name;
  for (const auto& s : specs) by_name.emplace(s.name, &s);

  std::vector<std::string> missing;
  std::vector<std::string> unexpected;
  std::vector<std::string> mismatched;
  for (const auto& spec : specs) {
    const TensorView* t = checkpoint.find(spec.name);
    if (spec.is_scale) {
      // A scale belongs to the weight before "_scale_inv"; it is required only for an FP8 weight.
      const std::string weight_name = spec.name.substr(0, spec.name.size() - std::string_view("_scale_inv").size());
      const TensorView* w = checkpoint.find(weight_name);
      const bool weight_is_fp8 = w != nullptr && w->dtype == DType::F8E4M3;
      if (t == nullptr) {
        if (weight_is_fp8) {
          missing.push_back(fmt::format("{} (F32 {}: the scale of F8_E4M3 weight {})", spec.name, shapeText(spec.shape),
                                        weight_name));
        }
        continue;
      }
      if (w != nullptr && !weight_is_fp8) {
        unexpected.push_back(
            fmt::format("{} ({} weight {} is not quantized)", spec.name, dtypeName(w->dtype), weight_name));
        continue;
      }
    } else if (t == nullptr) {
      missing.push_back(fmt::format("{} ({} {})", spec.name, dtypeName(spec.dtype), shapeText(spec.shape)));
      continue;
    }
    if (t->shape != spec.shape) {
      mismatched.push_back(
          fmt::format("{}: shape {}, expected {}", spec.name, shapeText(t->shape), shapeText(spec.shape)));
    }
    bool dtype_ok = false;
    std::string allowed;
    if (spec.is_scale) {
      dtype_ok = t->dtype == DType::F32;
      allowed = "F32";
    } else if (spec.quantizable && config.quantization) {
      dtype_ok = t->dtype == DType::F8E4M3 || isFloatDType(t->dtype);
      allowed = "F8_E4M3 (with a scale), BF16, F16 or F32";
    } else {
      dtype_ok = isFloatDType(t->dtype);
      allowed = spec.quantizable ? "BF16, F16 or F32 (config.json has no quantization_config)" : "BF16, F16 or F32";
    }
    if (!dtype_ok) {
      mismatched.push_back(fmt::format("{}: dtype {}, expected {}", spec.name, dtypeName(t->dtype), allowed));
    }
  }
  for (const TensorView* t : checkpoint.tensors()) {
    if (by_name.find(t->name) == by_name.end()) {
      unexpected.push_back(fmt::format("{} ({} {} in {})", t->name, dtypeName(t->dtype), shapeText(t->shape),
                                       t->file.filename().string()));
    }
  }
  if (missing.empty() && unexpected.empty() && mismatched.empty()) return okStatus();

  std::string where = "checkpoint";
  if (!checkpoint.files().empty()) where = checkpoint.files().front().path().parent_path().string();
  std::string msg = fmt::format("{}: tensors do not match config.json: {} missing, {} unexpected, {} mismatched", where,
                                missing.size(), unexpected.size(), mismatched.size());
  for (const auto& m : missing) msg += "\n  missing: " + m;
  for (const auto& u : unexpected) msg += "\n  unexpected: " + u;
  for (const auto& m : mismatched) msg += "\n  mismatch: " + m;
  return makeError(ErrorCode::InvalidArgument, std::move(msg));
}

}  // namespace pd
