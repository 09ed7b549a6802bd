// `pdserve plan`'s command logic (plan_command.h): flags into a PlanInput, the calibration file,
// the reports.
#include <gtest/gtest.h>

#include <boost/json.hpp>
#include <fstream>

#include "plan_command.h"
#include "support/test_files.h"

namespace pd::plan {
namespace {

std::filesystem::path writeFile(const test::TempDir& dir, const std::string& text) {
  const auto path = dir.path() / "bench.json";
  std::ofstream(path) << text;
  return path;
}

TEST(PlanCommand, FlagsOverrideTheProfileInSiUnits) {
  PlanFlags f;
  f.hbm_bandwidth_gbs = 1000;
  f.net_latency_ms = 2;
  f.nvlink_latency_us = 5;
  f.gpus_per_node = 4;
  f.kv_dtype = "fp8";
  f.decode_tp = 16;
  f.ttft_slo_ms = 500;
  auto in = planInputFromFlags(f, nullptr);
  ASSERT_TRUE(in.ok()) << in.error().toString();
  EXPECT_DOUBLE_EQ(in->hardware.hbm_bandwidth, 1e12);
  EXPECT_DOUBLE_EQ(in->hardware.net_latency, 2e-3);
  EXPECT_DOUBLE_EQ(in->hardware.nvlink_latency, 5e-6);
  EXPECT_EQ(in->hardware.gpus_per_node, 4);
  EXPECT_DOUBLE_EQ(in->model.kv_dtype_bytes, 612.0 / 576.0);  // e4m3 codes + a float32 scale per 64 values
  EXPECT_EQ(in->decode.tp, 16);
  EXPECT_DOUBLE_EQ(in->slo.ttft, 0.5);
  // Unset hardware flags keep the h200 profile's values.
  auto h200 = builtinHardware("h200");
  ASSERT_TRUE(h200.ok());
  EXPECT_DOUBLE_EQ(in->hardware.hbm_capacity, h200->hbm_capacity);
}

TEST(PlanCommand, AutomaticTpIsTheFewestPowerOfTwoHoldingTheWeights) {
  PlanFlags f;  // deepseek-v3 (FP8, ~690 GB) on h200 (141 GB, 90 % usable)
  auto in = planInputFromFlags(f, nullptr);
  ASSERT_TRUE(in.ok()) << in.error().toString();
  const std::int64_t tp = autoTp(in->model, in->hardware);
  EXPECT_EQ(in->decode.tp, tp);
  EXPECT_EQ(in->prefill.tp, tp);
  EXPECT_EQ(tp & (tp - 1), 0) << "a power of two";
  EXPECT_LE(in->model.total_weight_bytes / static_cast<double>(tp), kHbmUsableFraction * in->hardware.hbm_capacity);
  EXPECT_GT(in->model.total_weight_bytes / static_cast<double>(tp / 2), kHbmUsableFraction * in->hardware.hbm_capacity);
}

TEST(PlanCommand, UnknownModelOrHardwareIsABadArgument) {
  PlanFlags f;
  f.model = "no-such-model";
  auto in = planInputFromFlags(f, nullptr);
  ASSERT_FALSE(in.ok());
  EXPECT_EQ(in.error().code, ErrorCode::InvalidArgument);
  f.model.clear();
  f.hardware = "abacus";
  in = planInputFromFlags(f, nullptr);
  ASSERT_FALSE(in.ok());
  EXPECT_NE(in.error().message.find("--hardware"), std::string::npos);
}

TEST(PlanCommand, CalibrationFileGivesCeilingsLayoutAndPoints) {
  test::TempDir dir;
  const auto path = writeFile(dir, R"({"model": "deepseek-v3", "hardware": "h800", "read_bandwidth_gbs": 2000,
    "tp": 8, "nodes": 1, "net_latency_ms": 0.5, "context": 1200,
    "decode": [{"concurrency": 1, "tokens_per_s": 20}, {"batch": 8, "output_throughput": 120, "net_latency_ms": 1}]})");
  auto file = readCalibrationFile(path);
  ASSERT_TRUE(file.ok()) << file.error().toString();
  ASSERT_EQ(file->points.size(), 2U);
  EXPECT_EQ(file->points[1].concurrency, 8);
  EXPECT_DOUBLE_EQ(file->points[1].tokens_per_s_total, 120);
  EXPECT_DOUBLE_EQ(file->points[0].net_latency, 0.5e-3) << "the file's latency";
  EXPECT_DOUBLE_EQ(file->points[1].net_latency, 1e-3) << "the level's own";
  EXPECT_DOUBLE_EQ(file->points[0].context, 1200);

  auto in = planInputFromFlags(PlanFlags{}, &*file);
  ASSERT_TRUE(in.ok()) << in.error().toString();
  EXPECT_DOUBLE_EQ(in->hardware.hbm_bandwidth, 2000e9) << "the measured ceiling replaces the profile's";
  EXPECT_NE(in->hardware.name.find("measured"), std::string::npos);
  EXPECT_EQ(in->decode.tp, 8);
  EXPECT_EQ(in->decode.nodes, 1);
}

// tests/data/plan/gpu-bench-engine.fixture.json is a synthetic test fixture (its "note" says so),
// not a measurement: no GPU has run pdserve.
TEST(PlanCommand, AGpuRunsFileGivesTheMeasuredCeilingsAndNoPoints) {
  const auto fixture = std::filesystem::path(PD_TEST_DATA_DIR) / "plan" / "gpu-bench-engine.fixture.json";
  auto file = readCalibrationFile(fixture);
  ASSERT_TRUE(file.ok()) << file.error().toString();
  EXPECT_EQ(file->backend, "cuda");
  EXPECT_EQ(file->device, "cuda:0");
  EXPECT_NE(file->note.find("TEST FIXTURE"), std::string::npos);
  EXPECT_TRUE(file->points.empty());
  auto profile = planInputFromFlags(PlanFlags{}, nullptr);
  auto in = planInputFromFlags(PlanFlags{}, &*file);
  ASSERT_TRUE(in.ok() && profile.ok());
  EXPECT_DOUBLE_EQ(in->hardware.hbm_bandwidth, 4000e9);
  EXPECT_DOUBLE_EQ(in->hardware.bf16_flops, 700e12);
  // FP8 keeps the h200 profile's FP8 : BF16 ratio.
  EXPECT_DOUBLE_EQ(in->hardware.fp8_flops / in->hardware.bf16_flops,
                   profile->hardware.fp8_flops / profile->hardware.bf16_flops);

  test::TempDir dir;
  const auto empty = writeFile(dir, R"({"backend": "cuda", "device": "cuda:0", "mbu_batch1": null})");
  auto refused = readCalibrationFile(empty);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message.find("a GPU run (backend cuda) needs"), std::string::npos);
  // A GPU run with --model carries the device decode step's rates: ceilings only, never fitted
  // (they are a make-model checkpoint's, not the planned model's).
  const auto with_decode = writeFile(
      dir,
      R"({"backend": "cuda", "read_bandwidth_gbs": 4000, "mbu_batch1": 0.5, "mbu_by_batch": {"1": 0.5, "128": null},
               "decode": [{"batch": 1, "tokens_per_s": 900, "mbu": 0.5}, {"batch": 8, "tokens_per_s": 5000}]})");
  auto ceilings_only = readCalibrationFile(with_decode);
  ASSERT_TRUE(ceilings_only.ok()) << ceilings_only.error().toString();
  EXPECT_TRUE(ceilings_only->points.empty());
  EXPECT_DOUBLE_EQ(ceilings_only->read_bandwidth_gbs, 4000.0);
  const auto bad = writeFile(dir, R"({"backend": "cuda", "gemm_bf16_tflops": -3})");
  EXPECT_EQ(readCalibrationFile(bad).error().code, ErrorCode::InvalidArgument);
  // A CPU file still needs its decode levels.
  const auto cpu = writeFile(dir, R"({"backend": "cpu/avx512", "read_bandwidth_gbs": 40})");
  EXPECT_NE(readCalibrationFile(cpu).error().message.find("non-empty array"), std::string::npos);
}

TEST(PlanCommand, CalibrationFileErrorsNameTheField) {
  test::TempDir dir;
  EXPECT_EQ(readCalibrationFile(dir.path() / "missing.json").error().code, ErrorCode::NotFound);
  const std::pair<const char*, const char*> cases[] = {
      {"not json", "not JSON"},
      {"[1]", "must be a JSON object"},
      {R"({"decode": []})", "non-empty array"},
      {R"({"tp": 1.5, "decode": [{"concurrency": 1, "tokens_per_s": 1}]})", "\"tp\" must be an integer"},
      {R"({"decode": [{"concurrency": 0, "tokens_per_s": 1}]})", "level 0: concurrency"},
      {R"({"decode": [{"concurrency": 1}]})", "level 0: needs \"tokens_per_s\""},
      {R"({"read_bandwidth_gbs": -1, "decode": [{"concurrency": 1, "tokens_per_s": 1}]})", "must be > 0"},
  };
  for (const auto& [text, expected] : cases) {
    auto file = readCalibrationFile(writeFile(dir, text));
    ASSERT_FALSE(file.ok()) << text;
    EXPECT_EQ(file.error().code, ErrorCode::InvalidArgument) << text;
    EXPECT_NE(file.error().message.find(expected), std::string::npos) << text << ": " << file.error().message;
  }
}

TEST(PlanCommand, ReportsCarryThePrediction) {
  auto in = planInputFromFlags(PlanFlags{}, nullptr);
  ASSERT_TRUE(in.ok());
  auto p = predict(*in);
  ASSERT_TRUE(p.ok()) << p.error().toString();
  const auto json = boost::json::parse(planReportJson(*in, *p)).as_object();
  EXPECT_NEAR(json.at("decode_tokens_per_s_total").to_number<double>(), p->decode.tokens_per_s_total,
              1e-9 * p->decode.tokens_per_s_total)
      << "10 significant digits";
  EXPECT_EQ(json.at("decode_layout").as_object().at("tp").as_int64(), in->decode.tp);
  const std::string text = planReportText(*in, *p);
  EXPECT_NE(text.find("model: "), std::string::npos);
  EXPECT_NE(text.find("prefill:decode pools"), std::string::npos);
}

}  // namespace
}  // namespace pd::plan
