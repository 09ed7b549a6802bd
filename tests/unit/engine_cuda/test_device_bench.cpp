// `pdserve bench engine --device cuda` without a device (the error every CPU-only machine gives),
// the ceilings' arithmetic, and the JSON report's fields. The measurement itself runs only on a
// GPU (scripts/gpu-check.sh).
#include <gtest/gtest.h>

#include <boost/json.hpp>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "bench/engine/device_engine_bench.h"
#include "pd/engine/engine.h"
#include "pd/engine/gpu.h"
#include "pd/engine/gpu_bench.h"
#include "pd/engine/latent_cache.h"
#include "pd/engine/model_config.h"

namespace {

using pd::gpu::DeviceCeilingsConfig;

TEST(DeviceBench, AttentionBytesAreTheLatentCacheOnceAndTheQueries) {
  const DeviceCeilingsConfig c;  // DeepSeek-V3: batch 64, 4k context, 128 heads, latent 576
  const double cache = 64.0 * 4096 * 576 * 2;
  const double queries = 64.0 * 128 * 576 * 4;
  EXPECT_DOUBLE_EQ(pd::gpu::attentionMinimumBytes(c, 2), cache + queries);
  EXPECT_DOUBLE_EQ(pd::gpu::attentionMinimumBytes(c, 4), 2 * cache + queries);
}

TEST(DeviceBench, BandwidthFraction) {
  EXPECT_DOUBLE_EQ(pd::gpu::bandwidthFraction(4e9, 0.001, 5e12), 0.8);
  EXPECT_EQ(pd::gpu::bandwidthFraction(0, 1, 1), 0.0);
  EXPECT_EQ(pd::gpu::bandwidthFraction(1, 0, 1), 0.0);
  EXPECT_EQ(pd::gpu::bandwidthFraction(1, 1, 0), 0.0);
}

TEST(DeviceBench, BadConfigNamesTheField) {
  DeviceCeilingsConfig c;
  c.attention_latent_dim = 2048;
  auto bad = pd::gpu::measureDeviceCeilings(c);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().code, pd::ErrorCode::InvalidArgument);
  EXPECT_NE(bad.error().message.find("attention_latent_dim = 2048"), std::string::npos) << bad.error().message;
  DeviceCeilingsConfig cpu;
  cpu.device = pd::gpu::ModelDevice{};
  EXPECT_FALSE(pd::gpu::validateDeviceCeilingsConfig(cpu).ok());
  EXPECT_TRUE(pd::gpu::validateDeviceCeilingsConfig(DeviceCeilingsConfig{}).ok());
}

TEST(DeviceBench, DecodeConfigNamesWhatIsWrong) {
  using pd::gpu::DeviceDecodeBenchConfig;
  EXPECT_TRUE(pd::gpu::validateDeviceDecodeBenchConfig(DeviceDecodeBenchConfig{}).ok());
  const auto message = [](const DeviceDecodeBenchConfig& c) {
    const pd::Status st = pd::gpu::validateDeviceDecodeBenchConfig(c);
    return st.ok() ? std::string("ok") : st.error().message;
  };
  DeviceDecodeBenchConfig c;
  c.context = 0;
  EXPECT_NE(message(c).find("context 0"), std::string::npos) << message(c);
  c = {};
  c.steps = 65537;
  EXPECT_NE(message(c).find("steps 65537"), std::string::npos) << message(c);
  c = {};
  c.batches = {};
  EXPECT_NE(message(c).find("no decode batch sizes"), std::string::npos) << message(c);
  c.batches = {0};
  EXPECT_NE(message(c).find("decode batch 0 is outside 1..64"), std::string::npos) << message(c);
  c.batches = {64};
  EXPECT_EQ(message(c), "ok");
  c.prefill_tokens = -1;
  EXPECT_NE(message(c).find("prefill tokens -1"), std::string::npos) << message(c);
  c.prefill_tokens = 0;  // no prefill
  EXPECT_EQ(message(c), "ok");
  c.prefill_repetitions = 0;
  EXPECT_NE(message(c).find("repetitions 0"), std::string::npos) << message(c);
}

// The device prefill's FLOP count is what the CPU engine counts (ForwardStats::flops) for the same
// prompt on the absorbed path with the last row's logits: both checkpoints (dense and MoE layers,
// q LoRA), prompts within a block, across blocks and past 64 rows.
TEST(DeviceBench, PrefillFlopsAreTheCpuEnginesCount) {
  for (const char* name : {"tiny-bf16", "tiny-fp8"}) {
    const auto dir = std::filesystem::path(PD_TEST_DATA_DIR) / "golden" / name;
    auto config = pd::ModelConfig::load(dir);
    ASSERT_TRUE(config.ok()) << config.error().toString();
    pd::model::CpuEngineOptions options;
    options.threads = 1;
    options.prefault_weights = false;
    auto engine = pd::model::createCpuEngine(dir, options);
    ASSERT_TRUE(engine.ok()) << engine.error().toString();
    for (const std::int64_t n : {1, 5, 100}) {
      auto cache = pd::model::PagedLatentCache::create(*config, 8, 16, pd::DType::F32);
      ASSERT_TRUE(cache.ok()) << cache.error().toString();
      std::vector<std::int32_t> tokens;
      for (std::int64_t p = 0; p < n; ++p) tokens.push_back(static_cast<std::int32_t>((1 + 104729 * p) % 1000));
      const std::vector<std::int32_t> table{0, 1, 2, 3, 4, 5, 6, 7};
      pd::model::SequenceChunk chunk;
      chunk.tokens = tokens;
      chunk.start_pos = 0;
      chunk.block_table = table;
      pd::model::ForwardOptions fo;
      fo.attention = pd::model::AttentionPath::Absorbed;
      fo.logits = pd::model::OutputRows::Last;
      auto out = (*engine)->forward(std::vector<pd::model::SequenceChunk>{chunk}, cache->view(), fo);
      ASSERT_TRUE(out.ok()) << out.error().toString();
      ASSERT_GT(out->stats.flops, 0U);
      EXPECT_EQ(pd::gpu::devicePrefillFlops(*config, n), static_cast<double>(out->stats.flops))
          << name << ", " << n << " tokens";
    }
  }
  pd::ModelConfig none;
  EXPECT_EQ(pd::gpu::devicePrefillFlops(none, 0), 0.0);
  pd::gpu::PrefillResult p;
  p.flops = 3e12;
  p.seconds = 0.01;
  EXPECT_DOUBLE_EQ(pd::gpu::prefillGemmFraction(p, 6e14), 0.5);
  EXPECT_EQ(pd::gpu::prefillGemmFraction(p, 0.0), 0.0);
  p.seconds = 0.0;
  EXPECT_EQ(pd::gpu::prefillGemmFraction(p, 6e14), 0.0);
}

TEST(DeviceBench, NoDeviceIsAClearError) {
  if (pd::gpu::deviceCount() > 0) GTEST_SKIP() << "a CUDA device is visible";
  auto r = pd::bench::runDeviceEngineBench(pd::bench::DeviceEngineBenchConfig{});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, pd::ErrorCode::Unsupported);
  EXPECT_NE(r.error().message.find("cuda:0: no CUDA device"), std::string::npos) << r.error().message;
  const auto dir = std::filesystem::path(PD_TEST_DATA_DIR) / "golden" / "tiny-fp8";
  pd::gpu::DeviceDecodeBenchConfig decode_cfg;
  decode_cfg.context = 4;
  decode_cfg.steps = 2;
  auto model =
      pd::gpu::measureModelOnDevice(dir, pd::gpu::ModelDevice{pd::gpu::ModelDevice::Kind::Cuda, 0}, decode_cfg);
  ASSERT_FALSE(model.ok());
  EXPECT_EQ(model.error().code, pd::ErrorCode::Unsupported);
  EXPECT_NE(model.error().message.find("no CUDA device"), std::string::npos) << model.error().message;
  // A bad decode config is named before anything else, GPU or not.
  decode_cfg.batches = {1, 65};
  auto bad = pd::gpu::measureModelOnDevice(dir, pd::gpu::ModelDevice{pd::gpu::ModelDevice::Kind::Cuda, 0}, decode_cfg);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().code, pd::ErrorCode::InvalidArgument);
  EXPECT_NE(bad.error().message.find("decode batch 65 is outside 1..64"), std::string::npos) << bad.error().message;
  // With a model, batches over a step's limit alone leave nothing to measure.
  pd::bench::DeviceEngineBenchConfig over;
  over.model = dir;
  over.batches = {128};
  auto none = pd::bench::runDeviceEngineBench(over);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.error().code, pd::ErrorCode::InvalidArgument);
  EXPECT_NE(none.error().message.find("no batch of 1..64"), std::string::npos) << none.error().message;
}

TEST(DeviceBench, JsonReportHasTheCeilingsAndNullsForTheMissingEngine) {
  pd::bench::DeviceEngineBenchResult result;
  pd::gpu::DeviceCeilings& r = result.ceilings;
  r.device = "cuda:0 (a \"quoted\" name)";
  r.read_bandwidth = 4.0e12;
  r.gemm_flops = 7.5e14;
  r.attention_seconds = 0.002;
  r.attention_bytes = pd::gpu::attentionMinimumBytes(r.config, 2);
  r.attention_hbm_fraction = pd::gpu::bandwidthFraction(r.attention_bytes, r.attention_seconds, r.read_bandwidth);
  const std::string text = pd::bench::deviceReportJson(result);
  boost::system::error_code ec;
  const boost::json::value v = boost::json::parse(text, ec);
  ASSERT_FALSE(ec) << text;
  const auto& o = v.as_object();
  EXPECT_EQ(o.at("backend").as_string(), "cuda");
  EXPECT_EQ(o.at("device").as_string(), r.device);
  EXPECT_NEAR(o.at("read_bandwidth_gbs").to_number<double>(), 4000.0, 1e-3);
  EXPECT_NEAR(o.at("gemm_bf16_tflops").to_number<double>(), 750.0, 1e-3);
  EXPECT_NEAR(o.at("attention_hbm_fraction").to_number<double>(), r.attention_hbm_fraction, 1e-4);
  EXPECT_NEAR(o.at("attention_ms").to_number<double>(), 2.0, 1e-4);
  EXPECT_EQ(o.at("attention_batch").to_number<std::int64_t>(), 64);
  EXPECT_EQ(o.at("attention_context").to_number<std::int64_t>(), 4096);
  EXPECT_TRUE(o.at("mbu_batch1").is_null());
  EXPECT_TRUE(o.at("prefill_gemm_fraction").is_null());
  EXPECT_TRUE(o.at("prefill").is_null());
  EXPECT_TRUE(o.at("decode").as_array().empty());
  EXPECT_TRUE(o.at("mbu_by_batch").as_object().empty());
  EXPECT_NE(std::string(o.at("note").as_string()).find("mbu_batch1 needs --model"), std::string::npos);
  EXPECT_NE(std::string(o.at("note").as_string()).find("prefill_gemm_fraction is not measured"), std::string::npos);
  EXPECT_TRUE(o.at("weight_upload").is_null());
  const std::string plain = pd::bench::deviceReportText(result);
  EXPECT_NE(plain.find("fraction of HBM bandwidth"), std::string::npos) << plain;
  // With an upload: its own object.
  result.upload = pd::gpu::WeightUploadResult{"/m", 10, 4, 2e9, 0.5};
  const boost::json::value w = boost::json::parse(pd::bench::deviceReportJson(result), ec);
  ASSERT_FALSE(ec);
  const auto& u = w.as_object().at("weight_upload").as_object();
  EXPECT_EQ(u.at("fp8_tensors").to_number<std::int64_t>(), 4);
  EXPECT_NEAR(u.at("gbs").to_number<double>(), 4.0, 1e-6);
  // With decode measurements: mbu = bytes / seconds / read bandwidth, per batch; batch 128 (over
  // a step's limit) is null and the note says why.
  pd::gpu::DecodeStepResult d;
  d.numerics = pd::gpu::Numerics::Bf16;
  d.batch = 1;
  d.context = 256;
  d.steps = 8;
  d.step_seconds = 0.001;
  d.bytes_per_step = 2e9;  // 2 TB/s of 4
  d.experts_used = 8;
  EXPECT_DOUBLE_EQ(pd::gpu::decodeStepMbu(d, r.read_bandwidth), 0.5);
  EXPECT_DOUBLE_EQ(pd::gpu::decodeStepMbu(d, 0.0), 0.0);
  pd::gpu::DecodeStepResult d8 = d;
  d8.batch = 8;
  d8.step_seconds = 0.002;
  d8.bytes_per_step = 6e9;  // 3 TB/s of 4
  d8.experts_used = 40.5;
  result.decode = {d, d8};
  result.unmeasured_batches = {128};
  const boost::json::value m = boost::json::parse(pd::bench::deviceReportJson(result), ec);
  ASSERT_FALSE(ec) << pd::bench::deviceReportJson(result);
  EXPECT_NEAR(m.at("mbu_batch1").to_number<double>(), 0.5, 1e-6);
  const auto& by = m.at("mbu_by_batch").as_object();
  EXPECT_NEAR(by.at("1").to_number<double>(), 0.5, 1e-6);
  EXPECT_NEAR(by.at("8").to_number<double>(), 0.75, 1e-6);
  EXPECT_TRUE(by.at("128").is_null());
  const auto& decodes = m.at("decode").as_array();
  ASSERT_EQ(decodes.size(), 2U);
  const auto& dj = decodes[1].as_object();
  EXPECT_EQ(dj.at("batch").to_number<std::int64_t>(), 8);
  EXPECT_EQ(dj.at("numerics").as_string(), "bf16");
  EXPECT_EQ(dj.at("context").to_number<std::int64_t>(), 256);
  EXPECT_NEAR(dj.at("step_ms").to_number<double>(), 2.0, 1e-6);
  EXPECT_NEAR(dj.at("tokens_per_s").to_number<double>(), 4000.0, 1e-3);
  EXPECT_NEAR(dj.at("experts_per_moe_layer").to_number<double>(), 40.5, 1e-6);
  EXPECT_NEAR(dj.at("gbs").to_number<double>(), 3000.0, 1e-3);
  EXPECT_NEAR(dj.at("mbu").to_number<double>(), 0.75, 1e-6);
  const std::string note(m.at("note").as_string());
  EXPECT_EQ(note.find("mbu_batch1 needs"), std::string::npos);
  EXPECT_NE(note.find("batches over 64 are not measured"), std::string::npos) << note;
  const std::string measured = pd::bench::deviceReportText(result);
  EXPECT_NE(measured.find("decode batch 1 (bf16 numerics"), std::string::npos) << measured;
  EXPECT_NE(measured.find("MBU 0.750"), std::string::npos) << measured;
  EXPECT_NE(note.find("prefill_gemm_fraction is not measured"), std::string::npos) << note;
  // With a prefill: its fraction of the GEMM ceiling (7.5e14 FLOP/s), and no prefill note.
  pd::gpu::PrefillResult p;
  p.numerics = pd::gpu::Numerics::Fp32;
  p.tokens = 512;
  p.repetitions = 3;
  p.seconds = 0.5;
  p.flops = 3.75e13;  // 75 TFLOP/s of 750
  p.cuda_graphs = true;
  result.prefill = p;
  const boost::json::value f = boost::json::parse(pd::bench::deviceReportJson(result), ec);
  ASSERT_FALSE(ec) << pd::bench::deviceReportJson(result);
  EXPECT_NEAR(f.at("prefill_gemm_fraction").to_number<double>(), 0.1, 1e-9);
  const auto& pj = f.at("prefill").as_object();
  EXPECT_EQ(pj.at("tokens").to_number<std::int64_t>(), 512);
  EXPECT_EQ(pj.at("numerics").as_string(), "fp32");
  EXPECT_NEAR(pj.at("tokens_per_s").to_number<double>(), 1024.0, 1e-6);
  EXPECT_NEAR(pj.at("tflops").to_number<double>(), 75.0, 1e-6);
  EXPECT_TRUE(pj.at("cuda_graphs").as_bool());
  EXPECT_EQ(std::string(f.at("note").as_string()).find("prefill_gemm_fraction"), std::string::npos);
  const std::string with_prefill = pd::bench::deviceReportText(result);
  EXPECT_NE(with_prefill.find("fraction of the BF16 GEMM ceiling 0.1000, CUDA graphs"), std::string::npos)
      << with_prefill;
  result.prefill.reset();
  // Without batch 1, mbu_batch1 is null (not another batch's figure).
  result.decode = {d8};
  const boost::json::value n = boost::json::parse(pd::bench::deviceReportJson(result), ec);
  ASSERT_FALSE(ec);
  EXPECT_TRUE(n.at("mbu_batch1").is_null());
}

}  // namespace
