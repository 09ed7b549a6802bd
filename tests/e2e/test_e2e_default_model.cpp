// The quick start's model: `pdserve up` with no --model serves the embedded default model
// (models/tiny-dsv3, trained by tools/train/, written from the binary into a fresh cache folder).
// Its chat answers at temperature 0 must equal, token for token and as text, what the independent
// PyTorch implementation answers (tools/train/reference_chat.py ->
// tests/data/default_model/reference.json) and be readable English (printable ASCII, mostly
// letters and spaces); with MTP speculation (up's default) and without. How often answers are on
// topic is measured by tools/train/eval_chat.py (models/README.md), not asserted here.
#include <gtest/gtest.h>

#include <boost/json.hpp>
#include <cctype>
#include <string>
#include <vector>

#include "support/local_cluster.h"
#include "support/test_files.h"

namespace pd::test {
namespace {

namespace json = boost::json;

struct Reference {
  std::string prompt;
  std::vector<std::int64_t> ids;
  std::string text;
  std::string finish_reason;
};

std::vector<Reference> references(int* max_tokens) {
  const auto doc = json::parse(readFile(std::filesystem::path(PD_TEST_DATA_DIR) / "default_model" / "reference.json"));
  *max_tokens = static_cast<int>(doc.at("max_tokens").to_number<std::int64_t>());
  std::vector<Reference> out;
  for (const auto& a : doc.at("answers").as_array()) {
    Reference r;
    r.prompt = std::string(a.at("prompt").as_string());
    for (const auto& t : a.at("ids").as_array()) r.ids.push_back(t.to_number<std::int64_t>());
    r.text = std::string(a.at("text").as_string());
    r.finish_reason = std::string(a.at("finish_reason").as_string());
    out.push_back(std::move(r));
  }
  return out;
}

// Printable ASCII only, and at least 85 % letters and spaces.
bool readableEnglish(const std::string& text) {
  if (text.empty()) return false;
  std::size_t letters = 0;
  for (const char c : text) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u > 0x7e) return false;
    if (std::isalpha(u) != 0 || c == ' ') ++letters;
  }
  return letters * 100 >= text.size() * 85;
}

constexpr std::int64_t kEos = 1;  // the model's <｜end▁of▁sentence｜> (tokenizer_config.json)

class E2eDefaultModel : public ::testing::TestWithParam<int> {};

TEST_P(E2eDefaultModel, ChatAnswersEqualThePyTorchReferenceAndAreReadable) {
  int max_tokens = 0;
  const std::vector<Reference> refs = references(&max_tokens);
  ASSERT_GE(refs.size(), 3U);
  TempDir cache;
  LocalCluster cluster({"--model.cache_dir=" + cache.path().string(), "--router.port=0", "--log.level=warn",
                        "--decode.num_speculative_tokens=" + std::to_string(GetParam())});
  ASSERT_FALSE(cluster.url().empty());
  for (const Reference& ref : refs) {
    const json::object body{{"model", "pdserve-default"},
                            {"messages", json::array{json::object{{"role", "user"}, {"content", ref.prompt}}}},
                            {"max_tokens", max_tokens},
                            {"temperature", 0},
                            {"return_token_ids", true}};
    const auto response = postJson(cluster, "/v1/chat/completions", json::serialize(body));
    ASSERT_EQ(response.status, 200) << response.body;
    const auto doc = json::parse(response.body);
    const auto& choice = doc.at("choices").as_array().at(0).as_object();
    const std::string content(choice.at("message").at("content").as_string());
    std::vector<std::int64_t> ids;
    if (const auto* t = choice.if_contains("token_ids"); t != nullptr && t->is_array()) {
      for (const auto& v : t->as_array()) ids.push_back(v.to_number<std::int64_t>());
    }
    std::vector<std::int64_t> expected_ids = ref.ids;
    if (ref.finish_reason == "stop") expected_ids.push_back(kEos);  // token_ids end with the EOS that stopped it
    EXPECT_EQ(content, ref.text) << ref.prompt;
    EXPECT_EQ(ids, expected_ids) << ref.prompt;
    EXPECT_EQ(std::string(choice.at("finish_reason").as_string()), ref.finish_reason) << ref.prompt;
    EXPECT_TRUE(readableEnglish(content)) << ref.prompt << " -> " << content;
  }
  // The default model came from the binary into the given cache.
  bool written = false;
  for (const auto& e : std::filesystem::directory_iterator(cache.path() / "models")) {
    written = written || (e.path().filename().string().starts_with("default-") &&
                          std::filesystem::is_regular_file(e.path() / "model.safetensors"));
  }
  EXPECT_TRUE(written);
}

INSTANTIATE_TEST_SUITE_P(Mtp, E2eDefaultModel, ::testing::Values(0, 1),
                         [](const auto& param_info) { return "mtp" + std::to_string(param_info.param); });

}  // namespace
}  // namespace pd::test
