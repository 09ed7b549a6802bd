// TokenizerPromptRenderer: the adapter from the front end's conversations and prompts to the
// real DeepSeek-V3 tokenizer and chat template, checked against golden renderings
// (tests/data/golden/tokenizer). The tokenizer and template themselves have their own tests.
#include <gtest/gtest.h>

#include <boost/json.hpp>
#include <filesystem>
#include <fstream>
#include <string>

#include "pd/router/tokenizer_prompt_renderer.h"

namespace pd::router {
namespace {

const TokenizerPromptRenderer& renderer() {
  static const auto r = [] {
    auto loaded = TokenizerPromptRenderer::load(PD_TOKENIZER_DIR);
    PD_CHECK_MSG(loaded.ok(), "the DeepSeek-V3 tokenizer is missing: run scripts/fetch-tokenizer.sh");
    return std::move(loaded).value();
  }();
  return *r;
}

std::vector<boost::json::object> goldenLines(const std::string& file) {
  // (A path, not string concatenation: gcc 12 reports a false -Warray-bounds on the latter here.)
  std::ifstream in(std::filesystem::path(PD_TEST_DATA_DIR) / "golden" / "tokenizer" / file);
  EXPECT_TRUE(in.good()) << file;
  std::vector<boost::json::object> out;
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty()) out.push_back(boost::json::parse(line).as_object());
  }
  return out;
}

std::vector<TokenId> ids(const boost::json::value& v) {
  std::vector<TokenId> out;
  for (const auto& x : v.as_array()) out.push_back(static_cast<TokenId>(x.as_int64()));
  return out;
}

TEST(TokenizerPromptRendererTest, ChatsWithTheGenerationPromptMatchGolden) {
  int checked = 0;
  for (const auto& c : goldenLines("chat_cases.jsonl")) {
    // The renderer always appends the generation prompt and passes no tools.
    if (!c.at("add_generation_prompt").as_bool() || !c.at("tools").is_null()) continue;
    ChatConversation conv;
    conv.messages_json = boost::json::serialize(c.at("messages"));
    auto got = renderer().renderChat(conv);
    ASSERT_TRUE(got.ok()) << c.at("category").as_string() << ": " << got.error().toString();
    EXPECT_EQ(got.value(), ids(c.at("ids"))) << conv.messages_json;
    ++checked;
  }
  EXPECT_GE(checked, 15);
}

TEST(TokenizerPromptRendererTest, PlainPromptsGetTheBosRule) {
  int checked = 0;
  for (const auto& c : goldenLines("cases.jsonl")) {
    const auto& text = c.at("text").as_string();
    auto got = renderer().tokenize(std::string_view(text.data(), text.size()));
    ASSERT_TRUE(got.ok()) << got.error().toString();
    EXPECT_EQ(got.value(), ids(c.at("ids_with_bos")));
    if (++checked == 40) break;
  }
  EXPECT_EQ(checked, 40);
  EXPECT_EQ(renderer().vocabSize(), 128815U);
}

TEST(TokenizerPromptRendererTest, BadInputIsInvalidArgumentWithoutEchoingIt) {
  auto bad_utf8 = renderer().tokenize("secret\xff");
  ASSERT_FALSE(bad_utf8.ok());
  EXPECT_EQ(bad_utf8.error().code, ErrorCode::InvalidArgument);
  EXPECT_EQ(bad_utf8.error().message.find("secret"), std::string::npos);
  ChatConversation conv;
  conv.messages_json = R"({"not":"an array"})";
  auto bad_chat = renderer().renderChat(conv);
  ASSERT_FALSE(bad_chat.ok());
  EXPECT_EQ(bad_chat.error().code, ErrorCode::InvalidArgument);
}

TEST(TokenizerPromptRendererTest, MissingFolderIsNotFound) {
  auto r = TokenizerPromptRenderer::load("/nonexistent/tokenizer");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, ErrorCode::NotFound);
}

}  // namespace
}  // namespace pd::router
