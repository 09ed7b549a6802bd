// Runs the real pdserve binary: `pdserve plan` with the documented example, text output, flag
// errors, a checkpoint folder as --model, and --calibrate on bench JSON files.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <boost/json.hpp>
#include <fstream>
#include <string>
#include <vector>

#include "support/cli_runner.h"
#include "support/test_files.h"

namespace {

using pd::test::readFile;
using pd::test::TempDir;

using pd::test::CommandResult;
using pd::test::pdserve;

boost::json::object parseObject(const std::string& text) {
  boost::system::error_code ec;
  boost::json::value v = boost::json::parse(text, ec);
  EXPECT_FALSE(ec) << ec.message() << "\n" << text;
  EXPECT_TRUE(v.is_object()) << text;
  return v.is_object() ? v.as_object() : boost::json::object{};
}

double number(const boost::json::object& o, std::string_view key) {
  const auto* v = o.if_contains(key);
  EXPECT_NE(v, nullptr) << key;
  if (v == nullptr) return -1;
  if (v->is_int64()) return static_cast<double>(v->as_int64());
  EXPECT_TRUE(v->is_double()) << key;
  return v->is_double() ? v->as_double() : -1;
}

const std::vector<std::string> kExample = {
    "plan",        "--model", "deepseek-v3",      "--hardware", "h20",           "--nodes", "2",
    "--decode-tp", "16",      "--net-latency-ms", "0.193",      "--concurrency", "1",       "--json"};

TEST(CliPlan, DocumentedExamplePrintsOneJsonObjectWithThePublishedSpeed) {
  const CommandResult r = pdserve(kExample);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto o = parseObject(r.out);
  EXPECT_NEAR(number(o, "decode_tokens_per_s_per_user"), 18.943, 18.943 * 0.15);
  EXPECT_NEAR(number(o, "decode_tokens_per_s_total"), number(o, "decode_tokens_per_s_per_user"), 1e-9);
  EXPECT_DOUBLE_EQ(number(o, "kv_bytes_per_token"), 576.0 * 61 * 2);
  EXPECT_DOUBLE_EQ(number(o, "kv_bytes_per_request"), 576.0 * 61 * 2 * (1024 + 256));
  ASSERT_TRUE(o.contains("step_time_ms") && o.at("step_time_ms").is_object());
  const auto& step = o.at("step_time_ms").as_object();
  for (const char* key : {"total", "weight_reads", "kv_reads", "compute", "collectives", "mtp_draft"}) {
    EXPECT_GE(number(step, key), 0.0) << key;
  }
  EXPECT_NEAR(number(step, "total"), 1000.0 / number(o, "decode_tokens_per_s_per_user"), 1e-6);
  ASSERT_TRUE(o.contains("ttft_ms") && o.at("ttft_ms").is_object());
  const auto& ttft = o.at("ttft_ms").as_object();
  EXPECT_NEAR(number(ttft, "total"),
              number(ttft, "queueing") + number(ttft, "prefill_compute") + number(ttft, "kv_transfer"), 1e-6);
  ASSERT_TRUE(o.contains("prefill_decode_ratio") && o.at("prefill_decode_ratio").is_object());
  EXPECT_TRUE(o.at("prefill_decode_ratio").as_object().contains("feasible"));
  ASSERT_TRUE(o.contains("decode_layout"));
  EXPECT_DOUBLE_EQ(number(o.at("decode_layout").as_object(), "nodes"), 2.0);

  // Underscores work as well as dashes, and the slower network is slower.
  std::vector<std::string> slow = kExample;
  slow[10] = "2.193";
  slow[9] = "--net_latency_ms";
  const CommandResult s = pdserve(slow);
  ASSERT_EQ(s.exit_code, 0) << s.err;
  EXPECT_NEAR(number(parseObject(s.out), "decode_tokens_per_s_per_user"), 4.85, 4.85 * 0.15);
}

TEST(CliPlan, TextOutputNamesEveryPart) {
  const CommandResult r = pdserve({"plan", "--hardware", "h200", "--concurrency", "64", "--mtp-k", "1"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* part : {"decode:", "weight reads", "KV reads", "collectives", "MTP draft", "ttft:", "queueing",
                           "prefill compute", "KV transfer", "bytes per token", "prefill:decode"}) {
    EXPECT_NE(r.out.find(part), std::string::npos) << part << "\n" << r.out;
  }
}

TEST(CliPlan, BadFlagsAreClearErrors) {
  struct Case {
    std::vector<std::string> args;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {{"plan", "--hardware", "b300"}, "unknown hardware 'b300'"},
      {{"plan", "--model", "deepseek-v9"}, "--model deepseek-v9"},
      {{"plan", "--decode-tp", "16", "--decode-ep", "3"}, "ep 3 must divide tp 16"},
      {{"plan", "--decode-tp", "16", "--nodes", "1"}, "needs 16 GPUs per node"},
      {{"plan", "--mtp-acceptance", "1.5"}, "mtp_acceptance"},
      {{"plan", "--concurrency", "zero"}, "concurrency"},
      {{"plan", "--no-such-flag", "1"}, "no_such_flag"},
      {{"plan", "--kv-dtype", "int4"}, "kv_dtype"},
      {{"plan", "stray"}, "no positional arguments"},
      {{"plan", "--model", "tiny", "--mtp-k", "1", "--hardware", "h20"}, ""},  // tiny has an MTP layer: fine
  };
  for (const auto& c : cases) {
    const CommandResult r = pdserve(c.args);
    if (c.needle.empty()) {
      EXPECT_EQ(r.exit_code, 0) << r.err;
      continue;
    }
    EXPECT_EQ(r.exit_code, 2) << c.args[1] << "\n" << r.err;
    // The config module may spell option names with dashes or underscores.
    std::string err = r.err;
    for (char& ch : err) ch = ch == '-' ? '_' : ch;
    std::string needle = c.needle;
    for (char& ch : needle) ch = ch == '-' ? '_' : ch;
    EXPECT_TRUE(r.err.find(c.needle) != std::string::npos || err.find(needle) != std::string::npos)
        << "expected '" << c.needle << "' in: " << r.err;
  }
}

TEST(CliPlan, ModelMayBeACheckpointFolder) {
  TempDir dir;
  {
    std::ofstream config(dir.path() / "config.json");
    config << R"({"model_type": "deepseek_v3", "vocab_size": 4096, "hidden_size": 512, "intermediate_size": 1024,
      "moe_intermediate_size": 128, "num_hidden_layers": 4, "first_k_dense_replace": 1, "num_attention_heads": 8,
      "q_lora_rank": 192, "kv_lora_rank": 128, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64,
      "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
      "max_position_embeddings": 2048, "num_nextn_predict_layers": 1})";
  }
  const CommandResult r =
      pdserve({"plan", "--model", dir.path().string(), "--hardware", "rtx4090", "--decode-tp", "1", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto o = parseObject(r.out);
  EXPECT_DOUBLE_EQ(number(o, "kv_bytes_per_token"), (128.0 + 32.0) * 4 * 2);
  EXPECT_GT(number(o, "decode_tokens_per_s_per_user"), 1000.0);  // a tiny model on a 1 TB/s card

  const CommandResult missing = pdserve({"plan", "--model", (dir.path() / "nope").string()});
  EXPECT_EQ(missing.exit_code, 2);
  EXPECT_NE(missing.err.find("not a folder and not a preset"), std::string::npos) << missing.err;
}

TEST(CliPlan, CalibrateFitsTheNetworkConstantsToThePublishedSweep) {
  TempDir dir;
  const auto bench = dir.path() / "bench.json";
  {
    std::ofstream f(bench);
    f << R"({"model": "deepseek-v3", "hardware": "h20", "tp": 16, "nodes": 2,
             "levels": [{"concurrency": 1, "output_tokens_per_s": 18.943, "net_latency_ms": 0.193},
                        {"concurrency": 1, "output_tokens_per_s": 4.85, "net_latency_ms": 2.193}]})";
  }
  const CommandResult r = pdserve({"plan", "--calibrate", bench.string(), "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto o = parseObject(r.out);
  ASSERT_TRUE(o.contains("hardware"));
  EXPECT_NEAR(number(o.at("hardware").as_object(), "net_latency_hops"), 0.619, 0.01);
  EXPECT_NEAR(number(o.at("hardware").as_object(), "net_collective_overhead_us"), 291, 3);
  EXPECT_LT(number(o, "rms_relative_error"), 1e-6);
  ASSERT_TRUE(o.contains("points") && o.at("points").is_array());
  EXPECT_EQ(o.at("points").as_array().size(), 2U);

  const CommandResult text = pdserve({"plan", "--calibrate", bench.string()});
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_NE(text.out.find("| concurrency |"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("--net-latency-hops"), std::string::npos) << text.out;
}

TEST(CliPlan, CalibrateReadsBenchEngineOutput) {
  TempDir dir;
  const auto bench = dir.path() / "engine.json";
  {
    // The shape of `pdserve bench engine --json` (docs/benchmarks.md), quiet-machine BF16 numbers.
    std::ofstream f(bench);
    f << R"({"model": "bench", "weight_dtype": "BF16", "backend": "cpu/avx512", "threads": 2,
             "read_bandwidth_gbs": 40.2, "peak_gflops": 110.0, "context": 256,
             "decode": [{"batch": 1, "tokens_per_s": 47.4}, {"batch": 4, "tokens_per_s": 98.2},
                        {"batch": 16, "tokens_per_s": 165.2}, {"batch": 64, "tokens_per_s": 235.7}]})";
  }
  const CommandResult r = pdserve({"plan", "--calibrate", bench.string(), "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto o = parseObject(r.out);
  const auto& hw = o.at("hardware").as_object();
  EXPECT_GT(number(hw, "memory_efficiency"), 0.2);
  EXPECT_LT(number(hw, "memory_efficiency"), 1.2);
  EXPECT_LT(number(o, "rms_relative_error"), 0.35);
  ASSERT_EQ(o.at("points").as_array().size(), 4U);

  const auto broken = dir.path() / "broken.json";
  {
    std::ofstream f(broken);
    f << R"({"decode": [{"batch": 1}]})";
  }
  const CommandResult bad = pdserve({"plan", "--calibrate", broken.string()});
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.err.find("tokens_per_s"), std::string::npos) << bad.err;
  const CommandResult absent = pdserve({"plan", "--calibrate", (dir.path() / "none.json").string()});
  EXPECT_NE(absent.exit_code, 0);
  EXPECT_NE(absent.err.find("cannot open"), std::string::npos) << absent.err;
}

// The GPU run's file (a synthetic fixture, labelled so: not a measurement) checks the planner's
// H200 ceilings and predictions against the measured ceilings.
TEST(CliPlan, CalibrateComparesAGpuRunsCeilingsWithTheH200Profile) {
  const auto fixture = std::string(PD_TEST_DATA_DIR) + "/plan/gpu-bench-engine.fixture.json";
  const CommandResult r = pdserve({"plan", "--calibrate", fixture, "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto o = parseObject(r.out);
  EXPECT_NE(std::string(o.at("note").as_string()).find("TEST FIXTURE"), std::string::npos);
  EXPECT_EQ(std::string(o.at("device").as_string()), "cuda:0");
  EXPECT_NE(std::string(o.at("fitted").as_string()).find("none"), std::string::npos);
  const auto& ceilings = o.at("ceilings").as_array();
  ASSERT_EQ(ceilings.size(), 2U);
  const auto& hbm = ceilings[0].as_object();
  EXPECT_DOUBLE_EQ(number(hbm, "measured"), 4000.0);
  EXPECT_NEAR(number(hbm, "ratio"), 4000.0 / number(hbm, "profile"), 1e-9);
  const auto& decode = o.at("decode").as_array();
  ASSERT_EQ(decode.size(), 3U);
  // Decode at batch 1 reads the weights: the slower measured bandwidth predicts fewer tokens/s.
  const auto& one = decode[0].as_object();
  EXPECT_LT(number(one, "measured_ceilings_tokens_per_s"), number(one, "profile_tokens_per_s"));
  EXPECT_GT(number(one, "measured_ceilings_tokens_per_s"), 0.0);

  const CommandResult text = pdserve({"plan", "--calibrate", fixture});
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_NE(text.out.find("file note: TEST FIXTURE"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("| hbm_read_gbs |"), std::string::npos) << text.out;
}

}  // namespace
