#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "pd/common/dtype.h"
#include "pd/common/sha256.h"
#include "pd/engine/default_model.h"
#include "pd/engine/model_config.h"
#include "pd/engine/model_factory.h"
#include "pd/engine/safetensors.h"
#include "support/test_files.h"

namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

using pd::test::goldenDir;

using pd::test::readFile;
using pd::test::TempDir;

void writeText(const fs::path& p, const std::string& text) {
  std::ofstream out(p, std::ios::binary);
  out << text;
}

pd::ModelConfig preset(const char* name, bool fp8 = false) {
  auto r = pd::presetConfig(name);
  EXPECT_TRUE(r.ok()) << name;
  pd::ModelConfig c = r.value();
  if (fp8) c.quantization = pd::Fp8Quantization{};
  return c;
}

pd::MakeModelSummary make(const pd::ModelConfig& c, const fs::path& dir, std::uint64_t seed = 7,
                          std::uint64_t max_shard = std::uint64_t{1} << 30) {
  pd::MakeModelOptions opt;
  opt.seed = seed;
  opt.max_shard_bytes = max_shard;
  auto r = pd::makeModel(c, dir, opt);
  EXPECT_TRUE(r.ok()) << r.error().toString();
  return r.ok() ? r.value() : pd::MakeModelSummary{};
}

std::vector<float> toFloats(const pd::TensorView& t) {
  std::vector<float> out(static_cast<std::size_t>(t.numel()));
  for (std::size_t i = 0; i < out.size(); ++i) {
    if (t.dtype == pd::DType::BF16) {
      std::uint16_t bits = 0;
      std::memcpy(&bits, t.data.data() + i * 2, 2);
      out[i] = pd::bf16ToFloat(bits);
    } else if (t.dtype == pd::DType::F32) {
      std::memcpy(&out[i], t.data.data() + i * 4, 4);
    } else {
      out[i] = pd::fp8e4m3ToFloat(static_cast<std::uint8_t>(t.data[i]));
    }
  }
  return out;
}

void expectMeanStd(const pd::Checkpoint& ck, const std::string& name, double mean, double stddev) {
  const pd::TensorView* t = ck.find(name);
  ASSERT_NE(t, nullptr) << name;
  const std::vector<float> v = toFloats(*t);
  double s = 0;
  double s2 = 0;
  for (const float x : v) {
    s += x;
    s2 += static_cast<double>(x) * x;
  }
  const double n = static_cast<double>(v.size());
  const double m = s / n;
  const double sd = std::sqrt(s2 / n - m * m);
  EXPECT_NEAR(m, mean, 4.0 * stddev / std::sqrt(n) + 1e-3) << name;
  EXPECT_NEAR(sd, stddev, stddev * (0.05 + 4.0 / std::sqrt(n))) << name;
}

TEST(ModelFactory, PresetsAreValid) {
  for (const char* name :
       {"tiny", "small", "bench", "default", "deepseek-v3-layers=1", "deepseek-v3-layers=4", "deepseek-v3-layers=61"}) {
    auto c = pd::presetConfig(name);
    ASSERT_TRUE(c.ok()) << name << ": " << c.error().toString();
    const pd::Status st = c->validate();
    EXPECT_TRUE(st.ok()) << name << ": " << st.error().toString();
  }
  EXPECT_EQ(pd::presetNames().size(), 5U);
}

TEST(ModelFactory, TinyPresetIsTheGoldenConfig) {
  EXPECT_EQ(preset("tiny"), pd::ModelConfig::load(goldenDir() / "tiny-bf16").value());
  EXPECT_EQ(preset("tiny", true), pd::ModelConfig::load(goldenDir() / "tiny-fp8").value());
}

TEST(ModelFactory, DeepSeekV3PresetHasRealDimensions) {
  const pd::ModelConfig c = preset("deepseek-v3-layers=2");
  EXPECT_EQ(c.hidden_size, 7168);
  EXPECT_EQ(c.n_routed_experts, 256);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_EQ(c.n_group, 8);
  EXPECT_EQ(c.topk_group, 4);
  EXPECT_EQ(c.q_lora_rank, 1536);
  EXPECT_EQ(c.kv_lora_rank, 512);
  EXPECT_EQ(c.qk_nope_head_dim, 128);
  EXPECT_EQ(c.qk_rope_head_dim, 64);
  EXPECT_EQ(c.v_head_dim, 128);
  EXPECT_EQ(c.num_attention_heads, 128);
  EXPECT_EQ(c.intermediate_size, 18432);
  EXPECT_EQ(c.moe_intermediate_size, 2048);
  EXPECT_EQ(c.vocab_size, 129280);
  EXPECT_EQ(c.num_hidden_layers, 2);
  EXPECT_EQ(c.first_k_dense_replace, 2);
  EXPECT_EQ(c.num_nextn_predict_layers, 1);
  EXPECT_EQ(preset("deepseek-v3-layers=61").first_k_dense_replace, 3);
  EXPECT_EQ(preset("default").vocab_size, 129280);
  EXPECT_EQ(preset("default").bos_token_id, 0);
  EXPECT_EQ(preset("default").eos_token_id, 1);
}

TEST(ModelFactory, BadPresetsAndDimensions) {
  for (const char* name : {"huge", "deepseek-v3-layers=0", "deepseek-v3-layers=62", "deepseek-v3-layers=x",
                           "deepseek-v3-layers=", "deepseek-v3-layers=3x"}) {
    auto c = pd::presetConfig(name);
    ASSERT_FALSE(c.ok()) << name;
    EXPECT_THAT(c.error().message, HasSubstr(name));
  }
  pd::ModelConfig c = preset("tiny");
  EXPECT_FALSE(pd::setDimension(c, "not_a_key", 3).ok());
  ASSERT_TRUE(pd::setDimension(c, "hidden_size", 384).ok());
  ASSERT_TRUE(pd::setDimension(c, "q_lora_rank", 0).ok());
  EXPECT_EQ(c.hidden_size, 384);
  EXPECT_EQ(c.q_lora_rank, 0);
  EXPECT_TRUE(c.validate().ok());
  ASSERT_TRUE(pd::setDimension(c, "n_group", 3).ok());
  const pd::Status st = c.validate();
  ASSERT_FALSE(st.ok());
  EXPECT_THAT(st.error().message, HasSubstr("'n_group'"));
  TempDir dir;
  auto made = pd::makeModel(c, dir.path(), {});
  ASSERT_FALSE(made.ok());
  EXPECT_THAT(made.error().message, HasSubstr("'n_group'"));
}

/// Writes one preset, re-opens it and checks config, layout and dtypes.
void roundTrip(const char* name, bool fp8) {
  SCOPED_TRACE(std::string(name) + (fp8 ? " fp8" : " bf16"));
  const pd::ModelConfig c = preset(name, fp8);
  TempDir dir;
  const pd::MakeModelSummary summary = make(c, dir.path());
  EXPECT_EQ(summary.tensors, static_cast<std::int64_t>(pd::expectedTensors(c).size()));
  auto loaded = pd::ModelConfig::load(dir.path());
  ASSERT_TRUE(loaded.ok()) << loaded.error().toString();
  EXPECT_EQ(loaded.value(), c);
  auto ck = pd::Checkpoint::open(dir.path());
  ASSERT_TRUE(ck.ok()) << ck.error().toString();
  const pd::Status st = pd::validateCheckpoint(loaded.value(), ck.value());
  EXPECT_TRUE(st.ok()) << st.error().toString();
  EXPECT_EQ(ck->totalTensorBytes(), summary.tensor_bytes);
  // Exactly the dtypes make-model promises.
  for (const auto& spec : pd::expectedTensors(c)) {
    const pd::TensorView* t = ck->find(spec.name);
    ASSERT_NE(t, nullptr) << spec.name;
    EXPECT_EQ(t->dtype, spec.dtype) << spec.name;
  }
}

TEST(ModelFactory, TinyRoundTripsBf16AndFp8) {
  roundTrip("tiny", false);
  roundTrip("tiny", true);
}

TEST(ModelFactory, SmallRoundTripsBf16AndFp8) {
  roundTrip("small", false);
  roundTrip("small", true);
}

TEST(ModelFactory, OverriddenDimensionsRoundTrip) {
  pd::ModelConfig c = preset("tiny", true);
  ASSERT_TRUE(pd::setDimension(c, "q_lora_rank", 0).ok());    // deepseek_v2-style q_proj
  ASSERT_TRUE(pd::setDimension(c, "hidden_size", 200).ok());  // partial FP8 blocks everywhere
  ASSERT_TRUE(pd::setDimension(c, "num_nextn_predict_layers", 2).ok());
  ASSERT_TRUE(pd::setDimension(c, "n_shared_experts", 0).ok());
  TempDir dir;
  make(c, dir.path());
  auto ck = pd::Checkpoint::open(dir.path());
  ASSERT_TRUE(ck.ok()) << ck.error().toString();
  const pd::Status st = pd::validateCheckpoint(pd::ModelConfig::load(dir.path()).value(), ck.value());
  EXPECT_TRUE(st.ok()) << st.error().toString();
  EXPECT_NE(ck->find("model.layers.4.eh_proj.weight"), nullptr);
  EXPECT_NE(ck->find("model.layers.0.self_attn.q_proj.weight"), nullptr);
  EXPECT_EQ(ck->find("model.layers.1.mlp.shared_experts.up_proj.weight"), nullptr);
  EXPECT_EQ(ck->find("model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv")->shape,
            (std::vector<std::int64_t>{1, 2}));
}

TEST(ModelFactory, SameSeedSameBytesOtherSeedDiffers) {
  const pd::ModelConfig c = preset("tiny", true);
  TempDir a;
  TempDir b;
  TempDir other;
  make(c, a.path(), 42);
  make(c, b.path(), 42);
  make(c, other.path(), 43);
  for (const char* f : {"config.json", "model.safetensors"}) {
    EXPECT_EQ(readFile(a.path() / f), readFile(b.path() / f)) << f;
  }
  EXPECT_NE(readFile(a.path() / "model.safetensors"), readFile(other.path() / "model.safetensors"));
  // Every random tensor differs with the seed, not just some. (Not the tiny scale tensors: a
  // block's amax is a bf16 value, so two seeds can share one.)
  auto ca = pd::Checkpoint::open(a.path());
  auto co = pd::Checkpoint::open(other.path());
  ASSERT_TRUE(ca.ok() && co.ok());
  for (const pd::TensorView* t : ca->tensors()) {
    if (t->name.ends_with("_scale_inv")) continue;
    const pd::TensorView* u = co->find(t->name);
    ASSERT_NE(u, nullptr);
    EXPECT_NE(std::memcmp(t->data.data(), u->data.data(), t->data.size()), 0) << t->name;
  }
}

TEST(ModelFactory, WeightStatisticsKeepActivationsOrderOne) {
  pd::ModelConfig c = preset("small");
  TempDir dir;
  make(c, dir.path(), 3);
  auto ck = pd::Checkpoint::open(dir.path());
  ASSERT_TRUE(ck.ok());
  expectMeanStd(ck.value(), "model.embed_tokens.weight", 0.0, 0.5);
  {
    // Normal, not just the right variance: the share within 1 and 2 standard deviations.
    const std::vector<float> v = toFloats(*ck->find("model.embed_tokens.weight"));
    double within1 = 0;
    double within2 = 0;
    for (const float x : v) {
      within1 += std::fabs(x) < 0.5F ? 1 : 0;
      within2 += std::fabs(x) < 1.0F ? 1 : 0;
    }
    EXPECT_NEAR(within1 / static_cast<double>(v.size()), 0.6827, 0.003);
    EXPECT_NEAR(within2 / static_cast<double>(v.size()), 0.9545, 0.002);
  }
  expectMeanStd(ck.value(), "model.layers.1.self_attn.q_a_proj.weight", 0.0, 1.0 / std::sqrt(512.0));
  expectMeanStd(ck.value(), "model.layers.1.mlp.experts.3.down_proj.weight", 0.0, 1.0 / std::sqrt(128.0));
  expectMeanStd(ck.value(), "model.layers.0.mlp.gate_proj.weight", 0.0, 1.0 / std::sqrt(512.0));
  expectMeanStd(ck.value(), "model.layers.4.eh_proj.weight", 0.0, 1.0 / std::sqrt(1024.0));
  expectMeanStd(ck.value(), "lm_head.weight", 0.0, 2.5 / std::sqrt(512.0));
  expectMeanStd(ck.value(), "model.layers.2.post_attention_layernorm.weight", 1.0, 0.1);
  const pd::TensorView* bias = ck->find("model.layers.1.mlp.gate.e_score_correction_bias");
  ASSERT_NE(bias, nullptr);
  EXPECT_EQ(bias->dtype, pd::DType::F32);
  const std::vector<float> b = toFloats(*bias);
  double s2 = 0;
  for (const float x : b) s2 += static_cast<double>(x) * x;
  EXPECT_NEAR(std::sqrt(s2 / static_cast<double>(b.size())), 0.05, 0.02);
}

TEST(ModelFactory, MtpCopiesAreBitIdentical) {
  TempDir dir;
  make(preset("tiny"), dir.path());
  auto ck = pd::Checkpoint::open(dir.path());
  ASSERT_TRUE(ck.ok());
  const auto same = [&](const char* a, const char* b) {
    const pd::TensorView* x = ck->find(a);
    const pd::TensorView* y = ck->find(b);
    ASSERT_TRUE(x != nullptr && y != nullptr);
    ASSERT_EQ(x->data.size(), y->data.size());
    EXPECT_EQ(std::memcmp(x->data.data(), y->data.data(), x->data.size()), 0) << a << " vs " << b;
  };
  same("model.embed_tokens.weight", "model.layers.3.embed_tokens.weight");
  same("lm_head.weight", "model.layers.3.shared_head.head.weight");
}

TEST(ModelFactory, Fp8DequantizesCloseToBf16) {
  pd::ModelConfig c = preset("tiny");
  ASSERT_TRUE(pd::setDimension(c, "hidden_size", 200).ok());  // partial edge blocks
  TempDir bf16_dir;
  TempDir fp8_dir;
  make(c, bf16_dir.path(), 11);
  c.quantization = pd::Fp8Quantization{};
  make(c, fp8_dir.path(), 11);
  auto bf = pd::Checkpoint::open(bf16_dir.path());
  auto q = pd::Checkpoint::open(fp8_dir.path());
  ASSERT_TRUE(bf.ok() && q.ok());
  int quantized = 0;
  for (const pd::TensorView* t : q->tensors()) {
    if (t->name.ends_with("_scale_inv")) continue;
    const pd::TensorView* ref = bf->find(t->name);
    ASSERT_NE(ref, nullptr) << t->name;
    if (t->dtype != pd::DType::F8E4M3) {
      // Unquantized tensors are the same bits in both checkpoints.
      EXPECT_EQ(std::memcmp(t->data.data(), ref->data.data(), t->data.size()), 0) << t->name;
      continue;
    }
    ++quantized;
    const pd::TensorView* scale = q->find(t->name + "_scale_inv");
    ASSERT_NE(scale, nullptr) << t->name;
    const std::vector<float> codes = toFloats(*t);
    const std::vector<float> scales = toFloats(*scale);
    const std::vector<float> want = toFloats(*ref);
    const std::int64_t rows = t->shape[0];
    const std::int64_t cols = t->shape[1];
    const std::int64_t scale_cols = scale->shape[1];
    std::vector<float> block_amax(scales.size(), 0.0F);
    for (std::int64_t i = 0; i < rows; ++i) {
      for (std::int64_t j = 0; j < cols; ++j) {
        const auto k = static_cast<std::size_t>(i * cols + j);
        const auto sk = static_cast<std::size_t>((i / 128) * scale_cols + j / 128);
        const float s = scales[sk];
        const float w = codes[k] * s;
        block_amax[sk] = std::max(block_amax[sk], std::fabs(want[k]));
        // e4m3: 3 mantissa bits (relative error <= 2^-4), subnormal step 2^-9 (absolute <= 2^-10).
        const float tol = std::max(std::fabs(want[k]) * 0.0625F, s * 0.0009765625F) * 1.0001F;
        ASSERT_LE(std::fabs(w - want[k]), tol) << t->name << " [" << i << ", " << j << "]";
      }
    }
    for (std::size_t sk = 0; sk < scales.size(); ++sk) {
      EXPECT_EQ(scales[sk], block_amax[sk] / 448.0F) << t->name << " block " << sk;
    }
  }
  EXPECT_EQ(quantized, 176);
}

TEST(ModelFactory, ShardsWithIndexLoadTheSameTensors) {
  const pd::ModelConfig c = preset("tiny", true);
  TempDir one;
  TempDir many;
  const auto single = make(c, one.path(), 5);
  const std::uint64_t max_shard = 1 << 20;
  const auto sharded = make(c, many.path(), 5, max_shard);
  EXPECT_EQ(single.shards, 1);
  EXPECT_TRUE(fs::exists(one.path() / "model.safetensors"));
  EXPECT_FALSE(fs::exists(one.path() / "model.safetensors.index.json"));
  ASSERT_GT(sharded.shards, 3);
  EXPECT_EQ(sharded.tensor_bytes, single.tensor_bytes);
  EXPECT_TRUE(fs::exists(many.path() / "model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(many.path() / "model.safetensors"));
  const std::string first = fmt::format("model-00001-of-{:05d}.safetensors", sharded.shards);
  const std::string last = fmt::format("model-{:05d}-of-{:05d}.safetensors", sharded.shards, sharded.shards);
  EXPECT_TRUE(fs::exists(many.path() / first)) << first;
  EXPECT_TRUE(fs::exists(many.path() / last)) << last;
  auto a = pd::Checkpoint::open(one.path());
  auto b = pd::Checkpoint::open(many.path());
  ASSERT_TRUE(a.ok()) << a.error().toString();
  ASSERT_TRUE(b.ok()) << b.error().toString();
  EXPECT_EQ(b->files().size(), static_cast<std::size_t>(sharded.shards));
  for (const auto& f : b->files()) {
    // Only a tensor larger than the limit may exceed it (the 1 MiB embeddings fit exactly).
    EXPECT_LE(f.fileSize(), max_shard + 65536) << f.path();
  }
  EXPECT_TRUE(pd::validateCheckpoint(c, b.value()).ok());
  ASSERT_EQ(a->tensors().size(), b->tensors().size());
  for (const pd::TensorView* t : a->tensors()) {
    const pd::TensorView* u = b->find(t->name);
    ASSERT_NE(u, nullptr) << t->name;
    ASSERT_EQ(t->data.size(), u->data.size());
    EXPECT_EQ(std::memcmp(t->data.data(), u->data.data(), t->data.size()), 0) << t->name;
    // A weight and its scale always share a shard.
    if (const pd::TensorView* s = b->find(t->name + "_scale_inv")) {
      EXPECT_EQ(s->file, u->file) << t->name;
    }
  }
}

TEST(ModelFactory, CopiesTokenizerAndRefusesNonEmptyFolder) {
  TempDir tok;
  writeText(tok.path() / "tokenizer.json", "{\"model\": {}}");
  writeText(tok.path() / "tokenizer_config.json", "{\"bos_token\": \"<b>\"}");
  TempDir dir;
  pd::MakeModelOptions opt;
  opt.tokenizer_dir = tok.path();
  auto r = pd::makeModel(preset("tiny"), dir.path(), opt);
  ASSERT_TRUE(r.ok()) << r.error().toString();
  EXPECT_EQ(readFile(dir.path() / "tokenizer.json"), "{\"model\": {}}");
  EXPECT_EQ(readFile(dir.path() / "tokenizer_config.json"), "{\"bos_token\": \"<b>\"}");

  auto again = pd::makeModel(preset("tiny"), dir.path(), opt);
  ASSERT_FALSE(again.ok());
  EXPECT_THAT(again.error().message, HasSubstr("not empty"));
  // Overwriting a sharded model with a single-file one leaves no stale shards behind.
  opt.overwrite = true;
  opt.max_shard_bytes = 1 << 20;
  ASSERT_TRUE(pd::makeModel(preset("tiny"), dir.path(), opt).ok());
  opt.max_shard_bytes = std::uint64_t{1} << 30;
  ASSERT_TRUE(pd::makeModel(preset("tiny"), dir.path(), opt).ok());
  EXPECT_FALSE(fs::exists(dir.path() / "model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(dir.path() / "model-00001-of-00002.safetensors"));
  EXPECT_TRUE(pd::Checkpoint::open(dir.path()).ok());

  TempDir empty_tok;
  TempDir out;
  opt.tokenizer_dir = empty_tok.path();
  auto missing = pd::makeModel(preset("tiny"), out.path(), opt);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.error().code, pd::ErrorCode::NotFound);
  EXPECT_THAT(missing.error().message, HasSubstr("tokenizer.json"));
}

// The embedded default model (models/tiny-dsv3): written once, atomically, into a folder named
// by its hash, byte for byte the embedded files, and a valid checkpoint with its own tokenizer.
TEST(ModelFactory, EnsureDefaultModelWritesTheEmbeddedModelOnceAtomically) {
  TempDir cache;
  auto first = pd::ensureDefaultModel(cache.path());
  ASSERT_TRUE(first.ok()) << first.error().toString();
  EXPECT_EQ(first.value(),
            cache.path() / "models" / ("default-" + std::string(pd::defaultModelSha256().substr(0, 12))));
  ASSERT_EQ(pd::defaultModelFiles().size(), 5U);
  for (const pd::EmbeddedFile& f : pd::defaultModelFiles()) {
    const std::string text = readFile(first.value() / f.name);
    ASSERT_EQ(text.size(), f.bytes.size()) << f.name;
    EXPECT_EQ(std::memcmp(text.data(), f.bytes.data(), text.size()), 0) << f.name;
  }
  auto file_hash = pd::sha256File(first.value() / "model.safetensors");
  ASSERT_TRUE(file_hash.ok());
  EXPECT_EQ(*file_hash, pd::defaultModelSha256());
  auto cfg = pd::ModelConfig::load(first.value());
  ASSERT_TRUE(cfg.ok()) << cfg.error().toString();
  auto ck = pd::Checkpoint::open(first.value());
  ASSERT_TRUE(ck.ok());
  EXPECT_TRUE(pd::validateCheckpoint(cfg.value(), ck.value()).ok());
  EXPECT_GT(cfg->num_nextn_predict_layers, 0) << "the default model has its MTP layer";
  // Only the finished folder remains: no temporary siblings.
  int entries = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(cache.path() / "models")) ++entries;
  EXPECT_EQ(entries, 1);

  const auto stamp = fs::last_write_time(first.value() / "config.json");
  auto second = pd::ensureDefaultModel(cache.path());
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(second.value(), first.value());
  EXPECT_EQ(fs::last_write_time(first.value() / "config.json"), stamp);  // not rewritten

  // Racing creators: every one gets the same complete folder.
  TempDir race;
  std::vector<std::thread> threads;
  std::vector<pd::Result<fs::path>> got(4, pd::makeError(pd::ErrorCode::Internal, "not run"));
  for (std::size_t i = 0; i < got.size(); ++i) {
    threads.emplace_back([&, i] { got[i] = pd::ensureDefaultModel(race.path()); });
  }
  for (auto& t : threads) t.join();
  for (const auto& g : got) {
    ASSERT_TRUE(g.ok()) << g.error().toString();
    EXPECT_TRUE(fs::is_regular_file(*g / "model.safetensors"));
  }
  entries = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(race.path() / "models")) ++entries;
  EXPECT_EQ(entries, 1);
}

}  // namespace
