// The trained default model (models/tiny-dsv3, BF16, and its FP8 copy models/tiny-dsv3-fp8)
// through `pdserve generate`, against the independent PyTorch implementation's greedy answers
// (tools/train/reference_chat.py -> tests/data/default_model/reference{,_fp8}.json): the same
// tokens with MTP off and on (k = 1), and the MTP drafts of this trained model mostly accepted.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <boost/json.hpp>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "support/cli_runner.h"
#include "support/test_files.h"

namespace pd::test {
namespace {

namespace fs = std::filesystem;
namespace json = boost::json;

// Runs `pdserve <args>`; its stdout's last line as JSON (null on failure).
json::value pdserveJson(const std::string& args) {
  const CommandResult r = pdserveCommandLine(args);
  if (r.exit_code != 0) {
    ADD_FAILURE() << "pdserve " << args << " exited with " << r.exit_code;
    return nullptr;
  }
  std::string out = r.out;
  while (!out.empty() && out.back() == '\n') out.pop_back();
  return json::parse(out.substr(out.rfind('\n') + 1));
}

std::string joined(const json::array& ids) {
  std::string s;
  for (const auto& v : ids) s += (s.empty() ? "" : ",") + std::to_string(v.to_number<std::int64_t>());
  return s;
}

class TrainedModel : public ::testing::TestWithParam<std::pair<std::string, std::string>> {};

TEST_P(TrainedModel, GreedyAnswersEqualPyTorchWithAndWithoutMtp) {
  const auto& [folder, reference] = GetParam();
  const fs::path model = fs::path(PD_MODELS_DIR) / folder;
  const auto ref = json::parse(readFile(fs::path(PD_TEST_DATA_DIR) / "default_model" / reference));
  const auto max_tokens = ref.at("max_tokens").to_number<std::int64_t>();
  constexpr std::int64_t kEos = 1;  // the model's <｜end▁of▁sentence｜> (tokenizer_config.json)
  std::int64_t proposed = 0;
  std::int64_t accepted = 0;
  for (const auto& a : ref.at("answers").as_array()) {
    const std::string prompt = joined(a.at("prompt_ids").as_array());
    json::array expected = a.at("ids").as_array();
    if (a.at("finish_reason").as_string() == "stop") expected.push_back(kEos);
    for (const int mtp : {0, 1}) {
      const json::value got =
          pdserveJson("generate --model " + model.string() + " --prompt-ids " + prompt + " --max-tokens " +
                      std::to_string(max_tokens) + " --mtp " + std::to_string(mtp) + " --stats true --threads 2");
      ASSERT_TRUE(got.is_object());
      EXPECT_EQ(got.at("ids").as_array(), expected) << a.at("prompt").as_string() << " (mtp " << mtp << ")";
      if (mtp == 1) {
        proposed += got.at("drafts_proposed").to_number<std::int64_t>();
        accepted += got.at("drafts_accepted").to_number<std::int64_t>();
      }
    }
  }
  ASSERT_GT(proposed, 0);
  const double acceptance = static_cast<double>(accepted) / static_cast<double>(proposed);
  RecordProperty("mtp_acceptance_k1", std::to_string(acceptance));
  EXPECT_GE(acceptance, 0.5) << accepted << " of " << proposed << " drafts accepted";
}

INSTANTIATE_TEST_SUITE_P(Models, TrainedModel,
                         ::testing::Values(std::pair<std::string, std::string>{"tiny-dsv3", "reference.json"},
                                           std::pair<std::string, std::string>{"tiny-dsv3-fp8", "reference_fp8.json"}),
                         [](const auto& param_info) { return param_info.param.first == "tiny-dsv3" ? "bf16" : "fp8"; });

}  // namespace
}  // namespace pd::test
