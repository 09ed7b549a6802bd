// Runs the real pdserve binary: `logits` and `generate` on the golden checkpoints.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "pd/engine/safetensors.h"
#include "support/cli_runner.h"

namespace {

namespace fs = std::filesystem;

const fs::path kGolden = fs::path(PD_TEST_DATA_DIR) / "golden";

using pd::test::CommandResult;
using pd::test::pdserveCommandLine;

std::vector<float> floats(const pd::SafetensorsFile& f, const std::string& name) {
  const pd::TensorView* t = f.find(name);
  if (t == nullptr || t->dtype != pd::DType::F32) return {};
  std::vector<float> v(static_cast<std::size_t>(t->numel()));
  std::memcpy(v.data(), t->data.data(), t->data.size());
  return v;
}

std::vector<std::int64_t> ids(const pd::SafetensorsFile& f, const std::string& name) {
  const pd::TensorView* t = f.find(name);
  std::vector<std::int64_t> v(static_cast<std::size_t>(t->numel()));
  std::memcpy(v.data(), t->data.data(), t->data.size());
  return v;
}

std::string joined(const std::vector<std::int64_t>& v, const char* sep) {
  std::string s;
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? sep : "") + std::to_string(v[i]);
  return s;
}

class CliModel : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    auto g = pd::SafetensorsFile::open(kGolden / GetParam() / "golden.safetensors");
    ASSERT_TRUE(g.ok());
    golden_ = std::make_unique<pd::SafetensorsFile>(std::move(g).value());
    prompt_ = joined(ids(*golden_, "p0.tokens"), ",");
  }
  std::string model() const { return (kGolden / GetParam()).string(); }
  std::unique_ptr<pd::SafetensorsFile> golden_;
  std::string prompt_;
};

TEST_P(CliModel, GenerateGreedyPrintsTheGoldenTokensWithAndWithoutMtp) {
  const std::string want = "{\"ids\": [" + joined(ids(*golden_, "p0.greedy"), ", ") + "]}\n";
  for (const char* mtp : {"0", "2"}) {
    const CommandResult r = pdserveCommandLine("generate --model " + model() + " --prompt-ids " + prompt_ +
                                               " --max-tokens 24 --mtp " + mtp);
    EXPECT_EQ(r.exit_code, 0);
    EXPECT_EQ(r.out, want) << "--mtp " << mtp;
  }
}

TEST_P(CliModel, SampledGenerationRepeatsForASeed) {
  const std::string args = "generate --model " + model() + " --prompt-ids " + prompt_ +
                           " --max-tokens 8 --temperature 0.9 --top-k 50 --ignore-eos --seed ";
  const CommandResult a = pdserveCommandLine(args + "11");
  const CommandResult b = pdserveCommandLine(args + "11");
  const CommandResult c = pdserveCommandLine(args + "12");
  EXPECT_EQ(a.exit_code, 0);
  EXPECT_EQ(a.out, b.out);
  EXPECT_NE(a.out, c.out);
}

TEST_P(CliModel, LogitsWritesTheGoldenTensors) {
  const fs::path out =
      fs::temp_directory_path() / ("pd_cli_logits_" + GetParam() + "_" + std::to_string(::getpid()) + ".safetensors");
  const CommandResult r =
      pdserveCommandLine("logits --model " + model() + " --prompt-ids " + prompt_ + " --out " + out.string());
  ASSERT_EQ(r.exit_code, 0);
  auto written = pd::SafetensorsFile::open(out);
  ASSERT_TRUE(written.ok());
  for (const auto& [name, tol] : std::vector<std::pair<std::string, double>>{{"logits_all", 1e-3},
                                                                             {"kv_cache", 2e-4},
                                                                             {"pe_cache", 2e-4},
                                                                             {"hidden_final", 2e-4},
                                                                             {"mtp_logits_nozero", 1e-3}}) {
    const std::vector<float> got = floats(*written, name);
    const std::vector<float> want = floats(*golden_, "p0." + name);
    ASSERT_FALSE(got.empty()) << name;
    ASSERT_LE(got.size(), want.size()) << name;  // mtp_logits_nozero: the first N rows
    double d = 0.0;
    for (std::size_t i = 0; i < got.size(); ++i) d = std::max(d, std::abs(static_cast<double>(got[i]) - want[i]));
    EXPECT_LE(d, tol) << name;
  }
  fs::remove(out);
}

INSTANTIATE_TEST_SUITE_P(Golden, CliModel, ::testing::Values("tiny-bf16", "tiny-fp8"));

TEST(CliModelErrors, BadInputIsExitCode2) {
  const std::string model = (kGolden / "tiny-bf16").string();
  EXPECT_EQ(pdserveCommandLine("generate --model " + model + " --prompt-ids 1,99999").exit_code, 2);
  EXPECT_EQ(pdserveCommandLine("generate --model " + model + " --prompt-ids 1,x").exit_code, 2);
  EXPECT_EQ(pdserveCommandLine("logits --model " + model + " --prompt-ids 1,2").exit_code, 2);  // no --out
  EXPECT_NE(pdserveCommandLine("generate --model /nonexistent --prompt-ids 1").exit_code, 0);
}

}  // namespace
