#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <boost/json.hpp>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "pd/engine/model_config.h"
#include "pd/engine/safetensors.h"
#include "support/test_files.h"

namespace {

namespace fs = std::filesystem;
namespace json = boost::json;
using ::testing::HasSubstr;

using pd::test::goldenDir;

/// A fresh temporary folder, removed with its contents at scope exit.
using pd::test::readFile;
using pd::test::TempDir;

json::object goldenConfigJson(const char* set) {
  return json::parse(readFile(goldenDir() / set / "config.json")).as_object();
}

pd::Result<pd::ModelConfig> parse(const json::object& o) {
  return pd::ModelConfig::fromJson(json::serialize(o), "test/config.json");
}

TEST(ModelConfig, ParsesGoldenTinyBf16) {
  auto r = pd::ModelConfig::load(goldenDir() / "tiny-bf16");
  ASSERT_TRUE(r.ok()) << r.error().toString();
  const pd::ModelConfig& c = r.value();
  EXPECT_EQ(c.model_type, "deepseek_v3");
  EXPECT_EQ(c.vocab_size, 2048);
  EXPECT_EQ(c.hidden_size, 256);
  EXPECT_EQ(c.intermediate_size, 512);
  EXPECT_EQ(c.moe_intermediate_size, 64);
  EXPECT_EQ(c.num_hidden_layers, 3);
  EXPECT_EQ(c.first_k_dense_replace, 1);
  EXPECT_EQ(c.num_attention_heads, 4);
  EXPECT_EQ(c.q_lora_rank, 96);
  EXPECT_EQ(c.kv_lora_rank, 64);
  EXPECT_EQ(c.qk_nope_head_dim, 32);
  EXPECT_EQ(c.qk_rope_head_dim, 16);
  EXPECT_EQ(c.v_head_dim, 32);
  EXPECT_EQ(c.n_routed_experts, 16);
  EXPECT_EQ(c.num_experts_per_tok, 4);
  EXPECT_EQ(c.n_group, 4);
  EXPECT_EQ(c.topk_group, 2);
  EXPECT_EQ(c.n_shared_experts, 1);
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 2.5);
  EXPECT_EQ(c.scoring_func, "sigmoid");
  EXPECT_EQ(c.topk_method, "noaux_tc");
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  EXPECT_EQ(c.max_position_embeddings, 256);
  ASSERT_TRUE(c.rope_scaling.has_value());
  EXPECT_EQ(c.rope_scaling->type, "yarn");
  EXPECT_DOUBLE_EQ(c.rope_scaling->factor, 4.0);
  EXPECT_EQ(c.rope_scaling->original_max_position_embeddings, 64);
  EXPECT_DOUBLE_EQ(c.rope_scaling->beta_fast, 32.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling->beta_slow, 1.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling->mscale, 1.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling->mscale_all_dim, 1.0);
  EXPECT_FALSE(c.quantization.has_value());
  EXPECT_EQ(c.num_nextn_predict_layers, 1);
  EXPECT_EQ(c.bos_token_id, 0);
  EXPECT_EQ(c.eos_token_id, 1);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.latentDim(), 80);
  EXPECT_EQ(c.kvLayers(), 4);
  EXPECT_FALSE(c.isMoeLayer(0));
  EXPECT_TRUE(c.isMoeLayer(1));
  EXPECT_TRUE(c.isMoeLayer(2));
  EXPECT_TRUE(c.isMoeLayer(3));  // the MTP layer
}

TEST(ModelConfig, ParsesGoldenTinyFp8) {
  auto r = pd::ModelConfig::load(goldenDir() / "tiny-fp8");
  ASSERT_TRUE(r.ok()) << r.error().toString();
  ASSERT_TRUE(r->quantization.has_value());
  EXPECT_EQ(r->quantization->fmt, "e4m3");
  EXPECT_EQ(r->quantization->activation_scheme, "dynamic");
  EXPECT_EQ(r->quantization->block_out, 128);
  EXPECT_EQ(r->quantization->block_in, 128);
  pd::ModelConfig without = r.value();
  without.quantization.reset();
  EXPECT_EQ(without, pd::ModelConfig::load(goldenDir() / "tiny-bf16").value());
}

TEST(ModelConfig, SoftmaxScaleMatchesGolden) {
  auto c = pd::ModelConfig::load(goldenDir() / "tiny-bf16").value();
  EXPECT_EQ(c.softmaxScale(), 0.18713033519502428);  // golden.json, to the last bit
  c.rope_scaling.reset();
  EXPECT_NEAR(c.softmaxScale(), 1.0 / std::sqrt(48.0), 1e-16);
  // The real DeepSeek-V3: 192^-0.5 * (1 + 0.1 ln 40)^2.
  c.qk_nope_head_dim = 128;
  c.qk_rope_head_dim = 64;
  c.rope_scaling = pd::RopeScaling{"yarn", 40.0, 4096, 32.0, 1.0, 1.0, 1.0};
  const double m = 1.0 + 0.1 * std::log(40.0);
  EXPECT_NEAR(c.softmaxScale(), m * m / std::sqrt(192.0), 1e-15);
}

TEST(ModelConfig, QLoraNullMeansDirectQProj) {
  json::object o = goldenConfigJson("tiny-bf16");
  o["q_lora_rank"] = nullptr;
  o["model_type"] = "deepseek_v2";
  auto r = parse(o);
  ASSERT_TRUE(r.ok()) << r.error().toString();
  EXPECT_EQ(r->q_lora_rank, 0);
  EXPECT_EQ(r->model_type, "deepseek_v2");
  std::map<std::string, std::vector<std::int64_t>> shapes;
  for (const auto& s : pd::expectedTensors(r.value())) shapes[s.name] = s.shape;
  EXPECT_EQ(shapes.count("model.layers.0.self_attn.q_a_proj.weight"), 0U);
  EXPECT_EQ(shapes.count("model.layers.0.self_attn.q_a_layernorm.weight"), 0U);
  EXPECT_EQ(shapes["model.layers.0.self_attn.q_proj.weight"], (std::vector<std::int64_t>{192, 256}));
  EXPECT_EQ(shapes["model.layers.3.self_attn.q_proj.weight"], (std::vector<std::int64_t>{192, 256}));
  // The key itself stays required: absent is not the same as null.
  o.erase("q_lora_rank");
  auto missing = parse(o);
  ASSERT_FALSE(missing.ok());
  EXPECT_THAT(missing.error().message, HasSubstr("'q_lora_rank'"));
}

struct BadCase {
  const char* what;
  void (*mutate)(json::object&);
  const char* key;  ///< the key the message must name
};

constexpr BadCase kBadCases[] = {
    {"missing hidden_size", [](json::object& o) { o.erase("hidden_size"); }, "'hidden_size': required key is missing"},
    {"string hidden_size", [](json::object& o) { o["hidden_size"] = "256"; }, "'hidden_size': expected an integer"},
    {"fractional hidden_size", [](json::object& o) { o["hidden_size"] = 256.5; }, "'hidden_size': expected an integer"},
    {"zero hidden_size", [](json::object& o) { o["hidden_size"] = 0; }, "'hidden_size': must be in 1.."},
    {"negative vocab", [](json::object& o) { o["vocab_size"] = -5; }, "'vocab_size'"},
    {"zero heads", [](json::object& o) { o["num_attention_heads"] = 0; }, "'num_attention_heads'"},
    {"kv heads differ", [](json::object& o) { o["num_key_value_heads"] = 1; }, "'num_key_value_heads'"},
    {"zero layers", [](json::object& o) { o["num_hidden_layers"] = 0; }, "'num_hidden_layers'"},
    {"zero kv_lora", [](json::object& o) { o["kv_lora_rank"] = 0; }, "'kv_lora_rank'"},
    {"negative q_lora", [](json::object& o) { o["q_lora_rank"] = -1; }, "'q_lora_rank'"},
    {"odd rope dim", [](json::object& o) { o["qk_rope_head_dim"] = 15; }, "'qk_rope_head_dim': must be even"},
    {"zero v_head_dim", [](json::object& o) { o["v_head_dim"] = 0; }, "'v_head_dim'"},
    {"zero moe width", [](json::object& o) { o["moe_intermediate_size"] = 0; }, "'moe_intermediate_size'"},
    {"experts not divisible", [](json::object& o) { o["n_group"] = 5; },
     "'n_group': n_routed_experts (16) must be divisible by n_group (5)"},
    {"groups of one expert",
     [](json::object& o) {
       o["n_group"] = 16;
       o["topk_group"] = 4;
     },
     "'n_group': noaux_tc"},
    {"topk_group > n_group", [](json::object& o) { o["topk_group"] = 5; }, "'topk_group': must be in 1..n_group (4)"},
    {"topk_group zero", [](json::object& o) { o["topk_group"] = 0; }, "'topk_group'"},
    {"too many experts per token", [](json::object& o) { o["num_experts_per_tok"] = 9; },
     "'num_experts_per_tok': 9 exceeds the 8 experts"},
    {"zero experts per token", [](json::object& o) { o["num_experts_per_tok"] = 0; }, "'num_experts_per_tok'"},
    {"zero routed experts", [](json::object& o) { o["n_routed_experts"] = 0; }, "'n_routed_experts'"},
    {"negative shared experts", [](json::object& o) { o["n_shared_experts"] = -1; }, "'n_shared_experts'"},
    {"dense layers > layers", [](json::object& o) { o["first_k_dense_replace"] = 4; },
     "'first_k_dense_replace': must be in 0..num_hidden_layers (3)"},
    {"zero moe_layer_freq", [](json::object& o) { o["moe_layer_freq"] = 0; }, "'moe_layer_freq'"},
    {"negative mtp layers", [](json::object& o) { o["num_nextn_predict_layers"] = -1; }, "'num_nextn_predict_layers'"},
    {"model type", [](json::object& o) { o["model_type"] = "llama"; }, "'model_type': 'llama'"},
    {"scoring func", [](json::object& o) { o["scoring_func"] = "relu"; }, "'scoring_func'"},
    {"topk method", [](json::object& o) { o["topk_method"] = "random"; }, "'topk_method'"},
    {"bool as string", [](json::object& o) { o["norm_topk_prob"] = "true"; },
     "'norm_topk_prob': expected true or false"},
    {"zero eps", [](json::object& o) { o["rms_norm_eps"] = 0.0; }, "'rms_norm_eps'"},
    {"negative theta", [](json::object& o) { o["rope_theta"] = -1.0; }, "'rope_theta'"},
    {"zero routed scale", [](json::object& o) { o["routed_scaling_factor"] = 0.0; }, "'routed_scaling_factor'"},
    {"missing max positions", [](json::object& o) { o.erase("max_position_embeddings"); }, "'max_position_embeddings'"},
    {"bos out of vocab", [](json::object& o) { o["bos_token_id"] = 2048; }, "'bos_token_id'"},
    {"eos negative", [](json::object& o) { o["eos_token_id"] = -1; }, "'eos_token_id'"},
    {"rope type", [](json::object& o) { o["rope_scaling"].as_object()["type"] = "linear"; },
     "'rope_scaling.type': 'linear' is not supported"},
    {"rope factor", [](json::object& o) { o["rope_scaling"].as_object()["factor"] = 0; }, "'rope_scaling.factor'"},
    {"rope factor type", [](json::object& o) { o["rope_scaling"].as_object()["factor"] = "4"; },
     "'rope_scaling.factor': expected a number"},
    {"rope original max",
     [](json::object& o) { o["rope_scaling"].as_object().erase("original_max_position_embeddings"); },
     "'rope_scaling.original_max_position_embeddings'"},
    {"rope betas", [](json::object& o) { o["rope_scaling"].as_object()["beta_slow"] = 64; },
     "'rope_scaling.beta_fast'"},
    {"rope not object", [](json::object& o) { o["rope_scaling"] = 4; }, "'rope_scaling': expected an object"},
    {"quant method",
     [](json::object& o) {
       o["quantization_config"] = json::object{{"quant_method", "gptq"}, {"weight_block_size", json::array{128, 128}}};
     },
     "'quantization_config.quant_method': 'gptq'"},
    {"quant fmt",
     [](json::object& o) {
       o["quantization_config"] =
           json::object{{"quant_method", "fp8"}, {"fmt", "e5m2"}, {"weight_block_size", json::array{128, 128}}};
     },
     "'quantization_config.fmt'"},
    {"quant block missing",
     [](json::object& o) {
       o["quantization_config"] = json::object{{"quant_method", "fp8"}};
     },
     "'quantization_config.weight_block_size'"},
    {"quant block shape",
     [](json::object& o) {
       o["quantization_config"] = json::object{{"quant_method", "fp8"}, {"weight_block_size", json::array{128}}};
     },
     "'quantization_config.weight_block_size'"},
    {"quant block zero",
     [](json::object& o) {
       o["quantization_config"] = json::object{{"quant_method", "fp8"}, {"weight_block_size", json::array{0, 128}}};
     },
     "'quantization_config.weight_block_size'"},
};

TEST(ModelConfig, EveryValidationErrorNamesKeyAndSource) {
  for (const auto& bad : kBadCases) {
    json::object o = goldenConfigJson("tiny-bf16");
    bad.mutate(o);
    auto r = parse(o);
    ASSERT_FALSE(r.ok()) << bad.what;
    EXPECT_EQ(r.error().code, pd::ErrorCode::InvalidArgument) << bad.what;
    EXPECT_THAT(r.error().message, HasSubstr("test/config.json")) << bad.what;
    EXPECT_THAT(r.error().message, HasSubstr(bad.key)) << bad.what;
  }
}

TEST(ModelConfig, ReportsEveryProblemAtOnce) {
  json::object o = goldenConfigJson("tiny-bf16");
  o["n_group"] = 5;
  o["first_k_dense_replace"] = 9;
  o["v_head_dim"] = 0;
  auto r = parse(o);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.error().message, HasSubstr("3 problems"));
  EXPECT_THAT(r.error().message, HasSubstr("'n_group'"));
  EXPECT_THAT(r.error().message, HasSubstr("'first_k_dense_replace'"));
  EXPECT_THAT(r.error().message, HasSubstr("'v_head_dim'"));
}

TEST(ModelConfig, MalformedJsonAndMissingFile) {
  auto bad = pd::ModelConfig::fromJson("{\"vocab_size\": 12,", "x/config.json");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.error().message, HasSubstr("x/config.json: not valid JSON"));
  auto arr = pd::ModelConfig::fromJson("[1, 2]", "y/config.json");
  ASSERT_FALSE(arr.ok());
  EXPECT_THAT(arr.error().message, HasSubstr("y/config.json"));
  TempDir dir;
  auto missing = pd::ModelConfig::load(dir.path());
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.error().code, pd::ErrorCode::NotFound);
  EXPECT_THAT(missing.error().message, HasSubstr("config.json"));
}

TEST(ModelConfig, AcceptsRealDeepSeekV3Config) {
  // The key values of deepseek-ai/DeepSeek-V3's config.json.
  json::object o = goldenConfigJson("tiny-fp8");
  o["vocab_size"] = 129280;
  o["hidden_size"] = 7168;
  o["intermediate_size"] = 18432;
  o["moe_intermediate_size"] = 2048;
  o["num_hidden_layers"] = 61;
  o["first_k_dense_replace"] = 3;
  o["num_attention_heads"] = 128;
  o["num_key_value_heads"] = 128;
  o["q_lora_rank"] = 1536;
  o["kv_lora_rank"] = 512;
  o["qk_nope_head_dim"] = 128;
  o["qk_rope_head_dim"] = 64;
  o["v_head_dim"] = 128;
  o["n_routed_experts"] = 256;
  o["num_experts_per_tok"] = 8;
  o["n_group"] = 8;
  o["topk_group"] = 4;
  o["max_position_embeddings"] = 163840;
  o["rope_scaling"] =
      json::object{{"beta_fast", 32}, {"beta_slow", 1},        {"factor", 40},
                   {"mscale", 1.0},   {"mscale_all_dim", 1.0}, {"original_max_position_embeddings", 4096},
                   {"type", "yarn"}};
  auto r = parse(o);
  ASSERT_TRUE(r.ok()) << r.error().toString();
  EXPECT_EQ(r->latentDim(), 576);
  EXPECT_EQ(r->kvLayers(), 62);
  const auto specs = pd::expectedTensors(r.value());
  // 3 dense + 58 MoE main layers and 1 MoE MTP layer.
  std::int64_t experts = 0;
  for (const auto& s : specs) experts += s.name.find(".experts.") != std::string::npos && !s.is_scale ? 1 : 0;
  EXPECT_EQ(experts, 59 * 256 * 3);
}

TEST(ModelConfig, ToJsonRoundTrips) {
  for (const char* set : {"tiny-bf16", "tiny-fp8"}) {
    const pd::ModelConfig c = pd::ModelConfig::load(goldenDir() / set).value();
    const std::string text = c.toJson();
    auto back = pd::ModelConfig::fromJson(text, "roundtrip");
    ASSERT_TRUE(back.ok()) << back.error().toString() << "\n" << text;
    EXPECT_EQ(back.value(), c) << set;
    // Hugging Face key names, values as written by the reference.
    const json::object o = json::parse(text).as_object();
    EXPECT_EQ(o.at("model_type").as_string(), "deepseek_v3");
    EXPECT_EQ(o.at("architectures").as_array()[0].as_string(), "DeepseekV3ForCausalLM");
    EXPECT_EQ(o.at("n_routed_experts").as_int64(), 16);
    EXPECT_EQ(o.at("num_key_value_heads").as_int64(), 4);
    EXPECT_EQ(o.at("rope_scaling").as_object().at("original_max_position_embeddings").as_int64(), 64);
    EXPECT_DOUBLE_EQ(o.at("rms_norm_eps").as_double(), 1e-6);
    EXPECT_EQ(o.contains("quantization_config"), std::string(set) == "tiny-fp8");
  }
  pd::ModelConfig odd = pd::ModelConfig::load(goldenDir() / "tiny-bf16").value();
  odd.q_lora_rank = 0;
  odd.rope_scaling.reset();
  odd.routed_scaling_factor = 0.1 + 0.2;  // not representable in short decimal
  odd.rms_norm_eps = 1.25e-7;
  odd.tie_word_embeddings = true;
  odd.quantization = pd::Fp8Quantization{"e4m3", "dynamic", 64, 32};
  const std::string text = odd.toJson();
  EXPECT_THAT(text, HasSubstr("\"q_lora_rank\": null"));
  auto back = pd::ModelConfig::fromJson(text, "roundtrip");
  ASSERT_TRUE(back.ok()) << back.error().toString();
  EXPECT_EQ(back.value(), odd);
}

TEST(ModelConfig, RopeScalingDefaultsFollowHuggingFace) {
  json::object o = goldenConfigJson("tiny-bf16");
  o["rope_scaling"] = json::object{{"rope_type", "yarn"}, {"factor", 4}, {"original_max_position_embeddings", 64}};
  auto r = parse(o);
  ASSERT_TRUE(r.ok()) << r.error().toString();
  EXPECT_DOUBLE_EQ(r->rope_scaling->beta_fast, 32.0);
  EXPECT_DOUBLE_EQ(r->rope_scaling->beta_slow, 1.0);
  EXPECT_DOUBLE_EQ(r->rope_scaling->mscale, 1.0);
  EXPECT_DOUBLE_EQ(r->rope_scaling->mscale_all_dim, 0.0);
  EXPECT_NEAR(r->softmaxScale(), 1.0 / std::sqrt(48.0), 1e-16);  // mscale_all_dim 0: no factor
  o["rope_scaling"] = nullptr;
  auto none = parse(o);
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->rope_scaling.has_value());
}

/// expectedTensors must describe the golden files exactly: names, shapes and dtypes.
void expectExactLayout(const char* set, std::size_t expected_count) {
  const pd::ModelConfig c = pd::ModelConfig::load(goldenDir() / set).value();
  auto ckpt = pd::Checkpoint::open(goldenDir() / set);
  ASSERT_TRUE(ckpt.ok()) << ckpt.error().toString();
  const auto specs = pd::expectedTensors(c);
  EXPECT_EQ(specs.size(), expected_count) << set;
  std::set<std::string> spec_names;
  for (const auto& s : specs) {
    EXPECT_TRUE(spec_names.insert(s.name).second) << "duplicate spec " << s.name;
    const pd::TensorView* t = ckpt->find(s.name);
    ASSERT_NE(t, nullptr) << set << ": " << s.name;
    EXPECT_EQ(t->shape, s.shape) << s.name;
    EXPECT_EQ(t->dtype, s.dtype) << s.name;
  }
  std::set<std::string> file_names;
  for (const pd::TensorView* t : ckpt->tensors()) file_names.insert(t->name);
  EXPECT_EQ(file_names, spec_names) << set;
  const pd::Status st = pd::validateCheckpoint(c, ckpt.value());
  EXPECT_TRUE(st.ok()) << st.error().toString();
}

TEST(ModelConfig, ExpectedTensorsMatchGoldenBf16Exactly) {
  expectExactLayout("tiny-bf16", 207);
}
TEST(ModelConfig, ExpectedTensorsMatchGoldenFp8Exactly) {
  expectExactLayout("tiny-fp8", 383);
}

TEST(ModelConfig, ScaleShapesAreCeilOfBlocks) {
  const pd::ModelConfig c = pd::ModelConfig::load(goldenDir() / "tiny-fp8").value();
  std::map<std::string, pd::TensorSpec> by_name;
  for (const auto& s : pd::expectedTensors(c)) by_name[s.name] = s;
  EXPECT_EQ(by_name["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape,
            (std::vector<std::int64_t>{1, 2}));
  EXPECT_EQ(by_name["model.layers.0.self_attn.q_b_proj.weight_scale_inv"].shape, (std::vector<std::int64_t>{2, 1}));
  EXPECT_TRUE(by_name["model.layers.0.self_attn.q_b_proj.weight_scale_inv"].is_scale);
  EXPECT_TRUE(by_name["model.layers.0.self_attn.q_b_proj.weight"].quantizable);
  // Not quantized: router, eh_proj, embeddings, heads.
  for (const char* name : {"model.layers.1.mlp.gate.weight", "model.layers.3.eh_proj.weight", "lm_head.weight",
                           "model.layers.3.shared_head.head.weight", "model.embed_tokens.weight"}) {
    EXPECT_FALSE(by_name[name].quantizable) << name;
    EXPECT_EQ(by_name.count(std::string(name) + "_scale_inv"), 0U) << name;
  }
}

/// Writes `tensors` as dir/model.safetensors next to a copy of `config_set`'s config.json.
void writeCheckpoint(const fs::path& dir, const std::vector<pd::TensorToWrite>& tensors) {
  const pd::Status st = pd::writeSafetensors(dir / "model.safetensors", tensors);
  ASSERT_TRUE(st.ok()) << st.error().toString();
}

TEST(ModelConfig, ValidateReportsEveryMismatch) {
  const pd::ModelConfig c = pd::ModelConfig::load(goldenDir() / "tiny-fp8").value();
  auto golden = pd::Checkpoint::open(goldenDir() / "tiny-fp8");
  ASSERT_TRUE(golden.ok()) << golden.error().toString();
  std::vector<pd::TensorToWrite> out;
  const std::vector<std::byte> short_norm(std::size_t{255} * 2);
  const std::vector<std::byte> int_norm(std::size_t{256} * 4);
  const std::vector<std::byte> extra(std::size_t{8} * 2);
  for (const pd::TensorView* t : golden->tensors()) {
    if (t->name == "model.layers.0.self_attn.q_a_proj.weight") continue;          // missing
    if (t->name == "model.layers.1.self_attn.o_proj.weight_scale_inv") continue;  // FP8 without scale
    if (t->name == "model.norm.weight") {
      out.push_back({t->name, pd::DType::BF16, {255}, short_norm});  // wrong shape
      continue;
    }
    if (t->name == "model.layers.0.input_layernorm.weight") {
      out.push_back({t->name, pd::DType::I32, {256}, int_norm});  // wrong dtype
      continue;
    }
    out.push_back({t->name, t->dtype, t->shape, t->data});
  }
  out.push_back({"model.layers.0.extra.weight", pd::DType::BF16, {8}, extra});  // unexpected
  TempDir dir;
  writeCheckpoint(dir.path(), out);
  auto ckpt = pd::Checkpoint::open(dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.error().toString();
  const pd::Status st = pd::validateCheckpoint(c, ckpt.value());
  ASSERT_FALSE(st.ok());
  const std::string& msg = st.error().message;
  EXPECT_EQ(st.error().code, pd::ErrorCode::InvalidArgument);
  EXPECT_THAT(msg, HasSubstr(dir.path().string()));
  EXPECT_THAT(msg, HasSubstr("2 missing, 1 unexpected, 2 mismatched"));
  EXPECT_THAT(msg, HasSubstr("missing: model.layers.0.self_attn.q_a_proj.weight (F8_E4M3 [96, 256])"));
  EXPECT_THAT(msg, HasSubstr("missing: model.layers.1.self_attn.o_proj.weight_scale_inv"));
  EXPECT_THAT(msg, HasSubstr("unexpected: model.layers.0.extra.weight"));
  EXPECT_THAT(msg, HasSubstr("mismatch: model.norm.weight: shape [255], expected [256]"));
  EXPECT_THAT(msg, HasSubstr("mismatch: model.layers.0.input_layernorm.weight: dtype I32"));
  // The scale of the missing q_a_proj is present but has no weight: it is not an error by itself.
  EXPECT_THAT(msg, ::testing::Not(HasSubstr("q_a_proj.weight_scale_inv")));
}

TEST(ModelConfig, Fp8CheckpointAgainstBf16ConfigIsReported) {
  const pd::ModelConfig bf16 = pd::ModelConfig::load(goldenDir() / "tiny-bf16").value();
  auto fp8 = pd::Checkpoint::open(goldenDir() / "tiny-fp8");
  ASSERT_TRUE(fp8.ok()) << fp8.error().toString();
  const pd::Status st = pd::validateCheckpoint(bf16, fp8.value());
  ASSERT_FALSE(st.ok());
  // 176 quantized weights: each a dtype mismatch, each scale unexpected.
  EXPECT_THAT(st.error().message, HasSubstr("0 missing, 176 unexpected, 176 mismatched"));
  EXPECT_THAT(st.error().message, HasSubstr("config.json has no quantization_config"));
}

TEST(ModelConfig, Bf16WeightsUnderFp8ConfigNeedNoScales) {
  // A partly dequantized checkpoint: BF16 weights are accepted without scales.
  const pd::ModelConfig fp8 = pd::ModelConfig::load(goldenDir() / "tiny-fp8").value();
  auto bf16 = pd::Checkpoint::open(goldenDir() / "tiny-bf16");
  ASSERT_TRUE(bf16.ok()) << bf16.error().toString();
  const pd::Status st = pd::validateCheckpoint(fp8, bf16.value());
  EXPECT_TRUE(st.ok()) << st.error().toString();
}

}  // namespace
