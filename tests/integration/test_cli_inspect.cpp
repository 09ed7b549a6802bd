// Runs the real pdserve binary: inspect on the golden checkpoints, on make-model outputs and on
// corrupted copies; make-model with presets, overrides, shards and bad input.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <boost/json.hpp>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "pd/engine/model_config.h"
#include "support/cli_runner.h"
#include "support/test_files.h"

namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

using pd::test::goldenDir;

using pd::test::readFile;
using pd::test::TempDir;

using pd::test::CommandResult;
using pd::test::pdserve;

/// Parameter count of the Hugging Face DeepSeek-V3 layout, from the dimensions alone.
struct Expected {
  std::int64_t main = 0;
  std::int64_t mtp = 0;
  std::int64_t routed_expert_params_main = 0;
};

Expected expectedParams(const pd::ModelConfig& c) {
  const std::int64_t d = c.hidden_size;
  const std::int64_t h = c.num_attention_heads;
  const std::int64_t qk = c.qk_nope_head_dim + c.qk_rope_head_dim;
  const std::int64_t attn =
      d + (c.q_lora_rank > 0 ? c.q_lora_rank * d + c.q_lora_rank + h * qk * c.q_lora_rank : h * qk * d) +
      (c.kv_lora_rank + c.qk_rope_head_dim) * d + c.kv_lora_rank +
      h * (c.qk_nope_head_dim + c.v_head_dim) * c.kv_lora_rank + d * h * c.v_head_dim + d;
  const auto mlp = [&](std::int64_t width) { return 3 * width * d; };
  const std::int64_t experts = c.n_routed_experts * mlp(c.moe_intermediate_size);
  const std::int64_t moe = c.n_routed_experts * d + c.n_routed_experts + experts +
                           (c.n_shared_experts > 0 ? mlp(c.moe_intermediate_size * c.n_shared_experts) : 0);
  Expected e;
  e.main = 2 * c.vocab_size * d + d;
  for (std::int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const bool is_moe = l >= c.first_k_dense_replace;
    e.main += attn + (is_moe ? moe : mlp(c.intermediate_size));
    e.routed_expert_params_main += is_moe ? experts : 0;
  }
  e.mtp = c.num_nextn_predict_layers * (2 * c.vocab_size * d + 2 * d + 2 * d * d + attn + moe + d);
  return e;
}

void expectLine(const std::string& out, const std::string& line) {
  EXPECT_THAT(out, HasSubstr(line + "\n")) << out;
}

TEST(CliInspect, GoldenTinyBf16) {
  const pd::ModelConfig c = pd::ModelConfig::load(goldenDir() / "tiny-bf16").value();
  const Expected e = expectedParams(c);
  EXPECT_EQ(e.main + e.mtp, 5594800);  // the golden file's element count
  const CommandResult r = pdserve({"inspect", (goldenDir() / "tiny-bf16").string()});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr(fmt::format("parameters total: {} (", e.main + e.mtp)));
  EXPECT_THAT(r.out, HasSubstr(fmt::format("parameters main: {} (", e.main)));
  EXPECT_THAT(r.out, HasSubstr(fmt::format("parameters mtp: {} (", e.mtp)));
  EXPECT_THAT(r.out, HasSubstr(fmt::format("bytes BF16: {} (", (e.main + e.mtp - 48) * 2)));
  EXPECT_THAT(r.out, HasSubstr("bytes F32: 192 (192 B; 3 tensors, 48 elements)"))
      << "two MoE layers + MTP: 3 x 16 F32 biases";
  // Main decode step: all main weights except 12 of 16 experts per MoE layer and all but one embedding row.
  const std::int64_t embed = c.vocab_size * c.hidden_size;
  const std::int64_t activated = (e.main - e.routed_expert_params_main * 12 / 16 - embed + c.hidden_size) * 2 -
                                 2 * c.n_routed_experts * 2;  // the F32 biases: 4 bytes, not 2
  EXPECT_THAT(r.out, HasSubstr(fmt::format("activated bytes per token: {} (", activated + 2 * c.n_routed_experts * 4)));
  EXPECT_THAT(r.out, HasSubstr("latent kv bytes per token: 480 (BF16, 3 main layers x 80 values); 640 with the MTP"));
  EXPECT_THAT(r.out, HasSubstr("softmax scale 0.18713033519502428"));
  expectLine(r.out, "tensors: 207, all match config.json");
  EXPECT_EQ(r.err, "");
}

TEST(CliInspect, GoldenTinyFp8) {
  const pd::ModelConfig c = pd::ModelConfig::load(goldenDir() / "tiny-fp8").value();
  const Expected e = expectedParams(c);
  const CommandResult r = pdserve({"inspect", (goldenDir() / "tiny-fp8").string()});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr(fmt::format("parameters total: {} (", e.main + e.mtp)));
  EXPECT_THAT(r.out, HasSubstr(fmt::format("parameters main: {} (", e.main)));
  EXPECT_THAT(r.out, HasSubstr(fmt::format("parameters mtp: {} (", e.mtp)));
  expectLine(r.out, "fp8 scale values: 370 (not counted as parameters)");
  EXPECT_THAT(r.out, HasSubstr("bytes F8_E4M3: "));
  EXPECT_THAT(r.out, HasSubstr("FP8 e4m3 weights, 128x128 block scales"));
  expectLine(r.out, "tensors: 383, all match config.json");
}

TEST(CliInspect, JsonOutput) {
  const CommandResult r = pdserve({"inspect", (goldenDir() / "tiny-fp8").string(), "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  boost::system::error_code ec;
  const boost::json::value v = boost::json::parse(r.out, ec);
  ASSERT_FALSE(ec) << r.out;
  const auto& o = v.as_object();
  EXPECT_EQ(o.at("parameters").at("total").as_int64(), 5594800);
  EXPECT_EQ(o.at("parameters").at("fp8_scale_values").as_int64(), 370);
  EXPECT_EQ(o.at("config").at("hidden_size").as_int64(), 256);
  EXPECT_EQ(o.at("latent_kv_bytes_per_token").at("main").as_int64(), 480);
  EXPECT_EQ(o.at("tensors").as_int64(), 383);
  EXPECT_TRUE(o.at("valid").as_bool());
  EXPECT_GT(o.at("bytes_by_dtype").at("F8_E4M3").at("bytes").as_int64(), 0);
  EXPECT_THAT(std::string(o.at("activated_bytes_per_token").at("definition").as_string()), HasSubstr("lm_head"));
}

TEST(CliInspect, MakeModelOutputsInspectClean) {
  TempDir tmp;
  struct Case {
    std::vector<std::string> flags;
    const char* config_from;  ///< the dims the output must have, as a preset name
  };
  const std::vector<Case> cases = {
      {{"--preset", "tiny"}, "tiny"},
      {{"--preset", "tiny", "--fp8", "--seed", "9"}, "tiny"},
      {{"--preset=small", "--fp8", "--shard-mb", "5"}, "small"},
      {{"--preset", "small"}, "small"},
  };
  int n = 0;
  for (const auto& c : cases) {
    const fs::path dir = tmp.path() / fmt::format("m{}", n++);
    std::vector<std::string> args = {"make-model", dir.string()};
    args.insert(args.end(), c.flags.begin(), c.flags.end());
    const CommandResult made = pdserve(args);
    ASSERT_EQ(made.exit_code, 0) << made.err;
    EXPECT_THAT(made.out, HasSubstr("wrote " + dir.string()));
    const CommandResult r = pdserve({"inspect", dir.string()});
    ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
    const pd::ModelConfig cfg = pd::ModelConfig::load(dir).value();
    const Expected e = expectedParams(cfg);
    EXPECT_THAT(r.out, HasSubstr(fmt::format("parameters total: {} (", e.main + e.mtp))) << r.out;
    EXPECT_THAT(r.out, HasSubstr("all match config.json"));
  }
  // --shard-mb 5 on the ~30 MB FP8 small model: several shards and an index.
  const fs::path sharded = tmp.path() / "m2";
  EXPECT_TRUE(fs::exists(sharded / "model.safetensors.index.json"));
  std::vector<std::string> shards;
  for (const auto& entry : fs::directory_iterator(sharded)) {
    if (entry.path().extension() == ".safetensors") shards.push_back(entry.path().filename().string());
  }
  ASSERT_GE(shards.size(), 3U);
  for (const auto& name : shards) {
    EXPECT_THAT(name, ::testing::MatchesRegex(fmt::format("model-[0-9]{{5}}-of-{:05d}\\.safetensors", shards.size())));
  }
}

TEST(CliInspect, MakeModelDimensionOverrides) {
  TempDir tmp;
  const fs::path dir = tmp.path() / "m";
  const CommandResult made =
      pdserve({"make-model", dir.string(), "--preset", "tiny", "--fp8", "--hidden-size", "192", "--q-lora-rank", "0",
               "--n-routed-experts", "8", "--num-nextn-predict-layers", "2"});
  ASSERT_EQ(made.exit_code, 0) << made.err;
  const pd::ModelConfig cfg = pd::ModelConfig::load(dir).value();
  EXPECT_EQ(cfg.hidden_size, 192);
  EXPECT_EQ(cfg.q_lora_rank, 0);
  EXPECT_EQ(cfg.n_routed_experts, 8);
  EXPECT_TRUE(cfg.quantization.has_value());
  const CommandResult r = pdserve({"inspect", dir.string()});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const Expected e = expectedParams(cfg);
  EXPECT_THAT(r.out, HasSubstr(fmt::format("parameters mtp: {} (", e.mtp)));
  EXPECT_THAT(r.out, HasSubstr("q_lora_rank none (q_proj)"));
  EXPECT_THAT(r.out, HasSubstr("+ 2 MTP"));
}

TEST(CliInspect, MakeModelRejectsBadInput) {
  TempDir tmp;
  const CommandResult preset = pdserve({"make-model", (tmp.path() / "a").string(), "--preset", "enormous"});
  EXPECT_EQ(preset.exit_code, 2);
  EXPECT_THAT(preset.err, HasSubstr("unknown preset 'enormous'"));
  const CommandResult dims = pdserve({"make-model", (tmp.path() / "b").string(), "--n-group", "3"});
  EXPECT_EQ(dims.exit_code, 2);
  EXPECT_THAT(dims.err, HasSubstr("'n_group'"));
  const CommandResult flag = pdserve({"make-model", (tmp.path() / "c").string(), "--no-such-flag", "1"});
  EXPECT_EQ(flag.exit_code, 2);
  EXPECT_THAT(flag.err, HasSubstr("--no-such-flag"));
  const CommandResult none = pdserve({"make-model"});
  EXPECT_EQ(none.exit_code, 2);
  ASSERT_EQ(pdserve({"make-model", (tmp.path() / "d").string()}).exit_code, 0);
  const CommandResult again = pdserve({"make-model", (tmp.path() / "d").string()});
  EXPECT_EQ(again.exit_code, 2);
  EXPECT_THAT(again.err, HasSubstr("--force"));
  EXPECT_EQ(pdserve({"make-model", (tmp.path() / "d").string(), "--force", "--seed", "2"}).exit_code, 0);
  const CommandResult help = pdserve({"make-model", "--help"});
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_THAT(help.out, HasSubstr("deepseek-v3-layers=N"));
  EXPECT_THAT(help.out, HasSubstr("hidden_size"));
}

/// A copy of the golden tiny-bf16 folder that a test may damage.
fs::path copyGolden(const fs::path& into) {
  fs::path dir = into / "tiny";
  fs::create_directories(dir);
  fs::copy_file(goldenDir() / "tiny-bf16" / "config.json", dir / "config.json");
  fs::copy_file(goldenDir() / "tiny-bf16" / "model.safetensors", dir / "model.safetensors");
  return dir;
}

TEST(CliInspect, TruncatedCheckpointIsAClearError) {
  TempDir tmp;
  const fs::path dir = copyGolden(tmp.path());
  fs::resize_file(dir / "model.safetensors", fs::file_size(dir / "model.safetensors") / 2);
  const CommandResult r = pdserve({"inspect", dir.string()});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.exit_code, 3);  // not a crash or "not built"
  EXPECT_THAT(r.err, HasSubstr("error"));
  EXPECT_THAT(r.err, HasSubstr("model.safetensors"));
}

TEST(CliInspect, GarbageHeaderIsAClearError) {
  TempDir tmp;
  const fs::path dir = copyGolden(tmp.path());
  {
    std::fstream f(dir / "model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(8);
    f.write("#garbage#", 9);
  }
  const CommandResult r = pdserve({"inspect", dir.string()});
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_THAT(r.err, HasSubstr("model.safetensors"));
}

TEST(CliInspect, ConfigMismatchListsEveryTensor) {
  TempDir tmp;
  const fs::path dir = copyGolden(tmp.path());
  std::string config = readFile(dir / "config.json");
  const std::string from = "\"n_routed_experts\": 16";
  ASSERT_NE(config.find(from), std::string::npos);
  config.replace(config.find(from), from.size(), "\"n_routed_experts\": 8");
  std::ofstream(dir / "config.json", std::ios::trunc) << config;
  const CommandResult r = pdserve({"inspect", dir.string()});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.out, HasSubstr("DO NOT match config.json"));
  // 8 surplus experts x 3 weights x 3 MoE layers, and 3 routers/biases of the wrong shape.
  EXPECT_THAT(r.err, HasSubstr("0 missing, 72 unexpected, 6 mismatched"));
  EXPECT_THAT(r.err, HasSubstr("unexpected: model.layers.1.mlp.experts.8.down_proj.weight"));
  EXPECT_THAT(r.err, HasSubstr("unexpected: model.layers.3.mlp.experts.15.up_proj.weight"));
  EXPECT_THAT(r.err, HasSubstr("mismatch: model.layers.2.mlp.gate.weight: shape [16, 256], expected [8, 256]"));
}

TEST(CliInspect, MissingFolderAndBadConfig) {
  TempDir tmp;
  const CommandResult missing = pdserve({"inspect", (tmp.path() / "nope").string()});
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_THAT(missing.err, HasSubstr("config.json"));
  const fs::path dir = copyGolden(tmp.path());
  std::ofstream(dir / "config.json", std::ios::trunc) << "{\"model_type\": \"deepseek_v3\"";
  const CommandResult bad = pdserve({"inspect", dir.string()});
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_THAT(bad.err, HasSubstr((dir / "config.json").string()));
  const CommandResult usage = pdserve({"inspect"});
  EXPECT_EQ(usage.exit_code, 2);
  EXPECT_EQ(pdserve({"inspect", "--help"}).exit_code, 0);
}

}  // namespace
