// Tool-call (DeepSeek-V3, V3.1) and R1 reasoning parsers: the parsed result of each text, and the
// same result however the text is split into streamed pieces (every single split point, every
// pair of split points, and one byte at a time).

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "pd/structured/tool_call_parser.h"
#include "unit/tokenizer/tokenizer_test_support.h"

namespace pd::structured {
namespace {

const std::string kCallsBegin = "<｜tool▁calls▁begin｜>";
const std::string kCallsEnd = "<｜tool▁calls▁end｜>";
const std::string kCallBegin = "<｜tool▁call▁begin｜>";
const std::string kCallEnd = "<｜tool▁call▁end｜>";
const std::string kSep = "<｜tool▁sep｜>";

std::string v3Call(const std::string& name, const std::string& args) {
  return kCallBegin + "function" + kSep + name + "\n```json\n" + args + "\n```" + kCallEnd;
}
std::string v31Call(const std::string& name, const std::string& args) {
  return kCallBegin + name + kSep + args + kCallEnd;
}

ToolParseResult feedPieces(ToolCallFormat format, const std::vector<std::string_view>& pieces) {
  ToolCallParser parser(format, "call_");
  ToolParseResult result;
  for (const auto piece : pieces) result.add(parser.feed(piece));
  result.add(parser.finish());
  return result;
}

// Every split of `text` into two and three pieces, and one byte at a time, gives `want`.
void expectSplitInvariant(ToolCallFormat format, const std::string& text, const ToolParseResult& want) {
  const std::string_view t(text);
  for (std::size_t i = 0; i <= t.size(); ++i) {
    ASSERT_EQ(feedPieces(format, {t.substr(0, i), t.substr(i)}), want) << "split at " << i << " of " << text;
    for (std::size_t j = i; j <= t.size(); j += 3) {
      ASSERT_EQ(feedPieces(format, {t.substr(0, i), t.substr(i, j - i), t.substr(j)}), want)
          << "split at " << i << "," << j << " of " << text;
    }
  }
  std::vector<std::string_view> bytes;
  for (std::size_t i = 0; i < t.size(); ++i) bytes.push_back(t.substr(i, 1));
  ASSERT_EQ(feedPieces(format, bytes), want) << "byte by byte: " << text;
}

void expectParse(ToolCallFormat format, const std::string& text, const ToolParseResult& want) {
  EXPECT_EQ(ToolCallParser::parseAll(format, "call_", text), want) << text;
  expectSplitInvariant(format, text, want);
}

TEST(ToolCallParser, DeepSeekV3) {
  const auto f = ToolCallFormat::DeepSeekV3;
  expectParse(f, "plain answer, no tools", {"plain answer, no tools", {}});
  expectParse(f, kCallsBegin + v3Call("get_weather", R"({"city": "Paris"})") + kCallsEnd,
              {"", {{"call_0", "get_weather", R"({"city": "Paris"})"}}});
  expectParse(f, "Let me check." + kCallsBegin + v3Call("a", R"({"x":1})") + "\n" + v3Call("b", "{}") + kCallsEnd,
              {"Let me check.", {{"call_0", "a", R"({"x":1})"}, {"call_1", "b", "{}"}}});
  expectParse(f, kCallsBegin + v3Call("code", "{\"s\": \"a`b``c\\n\"}") + kCallsEnd,
              {"", {{"call_0", "code", "{\"s\": \"a`b``c\\n\"}"}}});
  // Cut off by max_tokens inside the arguments: the call keeps what was written.
  expectParse(f, kCallsBegin + kCallBegin + "function" + kSep + "f\n```json\n{\"a\": [1,",
              {"", {{"call_0", "f", "{\"a\": [1,"}}});
  // Cut off inside the name: no call.
  expectParse(f, "x" + kCallsBegin + kCallBegin + "function" + kSep + "get_wea", {"x", {}});
  // A lone '<' and text that only looks like a marker stay content.
  expectParse(f, "a < b and <｜tool▁call x", {"a < b and <｜tool▁call x", {}});
  // Content after the section.
  expectParse(f, kCallsBegin + v3Call("f", "{}") + kCallsEnd + " done", {" done", {{"call_0", "f", "{}"}}});
}

TEST(ToolCallParser, DeepSeekV31) {
  const auto f = ToolCallFormat::DeepSeekV31;
  expectParse(f, kCallsBegin + v31Call("get_weather", R"({"city":"Oslo"})") + kCallsEnd,
              {"", {{"call_0", "get_weather", R"({"city":"Oslo"})"}}});
  expectParse(f, "Sure. " + kCallsBegin + v31Call("a", "{}") + v31Call("b", R"({"k":"```"})") + kCallsEnd,
              {"Sure. ", {{"call_0", "a", "{}"}, {"call_1", "b", R"({"k":"```"})"}}});
  expectParse(f, kCallsBegin + kCallBegin + "f" + kSep + R"({"a":"<｜tool)",
              {"", {{"call_0", "f", R"({"a":"<｜tool)"}}});
}

TEST(ToolCallParser, StreamsArgumentsIncrementally) {
  ToolCallParser parser(ToolCallFormat::DeepSeekV31, "call_");
  auto d = parser.feed(kCallsBegin + kCallBegin + "lookup" + kSep);
  ASSERT_EQ(d.tool_calls.size(), 1U);
  EXPECT_EQ(d.tool_calls[0], (ToolCallDelta{0, "call_0", "lookup", ""}));
  d = parser.feed(R"({"q": "a)");
  ASSERT_EQ(d.tool_calls.size(), 1U);
  EXPECT_EQ(d.tool_calls[0], (ToolCallDelta{0, "", "", R"({"q": "a)"}));
  d = parser.feed("\"}<｜tool▁call");  // the marker's start is held back
  ASSERT_EQ(d.tool_calls.size(), 1U);
  EXPECT_EQ(d.tool_calls[0].arguments, "\"}");
  d = parser.feed("▁end｜>" + kCallsEnd);
  EXPECT_TRUE(d.empty());
  EXPECT_TRUE(parser.sawToolCalls());
}

TEST(ToolCallParser, DetectsTheTemplatesFormat) {
  PD_REQUIRE_TOKENIZER(tok);
  EXPECT_EQ(detectToolCallFormat(tok.chatTemplateSource()), ToolCallFormat::DeepSeekV3);
  EXPECT_EQ(detectToolCallFormat("{{'<｜tool▁call▁begin｜>' + tool['function']['name'] + '<｜tool▁sep｜>' + "
                                 "tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}"),
            ToolCallFormat::DeepSeekV31);
  EXPECT_EQ(detectToolCallFormat("{{ messages }}"), std::nullopt);
  EXPECT_FALSE(detectReasoning(tok.chatTemplateSource()).uses_think);
  const auto r1 = detectReasoning("{% if add_generation_prompt %}{{'<｜Assistant｜><think>\\n'}}{% endif %}");
  EXPECT_TRUE(r1.uses_think);
  EXPECT_TRUE(r1.prompt_opens_think);
}

void expectReasoning(bool opened, const std::string& text, const std::string& reasoning, const std::string& content) {
  const auto all = ReasoningParser::parseAll(opened, text);
  EXPECT_EQ(all.reasoning, reasoning) << text;
  EXPECT_EQ(all.content, content) << text;
  auto run = [&](const std::vector<std::string_view>& pieces) {
    ReasoningParser parser(opened);
    ReasoningDelta sum;
    for (const auto p : pieces) {
      const auto d = parser.feed(p);
      sum.reasoning += d.reasoning;
      sum.content += d.content;
    }
    const auto d = parser.finish();
    sum.reasoning += d.reasoning;
    sum.content += d.content;
    return sum;
  };
  const std::string_view t(text);
  for (std::size_t i = 0; i <= t.size(); ++i) {
    for (std::size_t j = i; j <= t.size(); ++j) {
      const auto got = run({t.substr(0, i), t.substr(i, j - i), t.substr(j)});
      ASSERT_EQ(got.reasoning, reasoning) << "split " << i << "," << j << " of " << text;
      ASSERT_EQ(got.content, content) << "split " << i << "," << j << " of " << text;
    }
  }
}

TEST(ReasoningParser, SplitsThinkFromContent) {
  expectReasoning(false, "<think>\nI should add.\n</think>\n\nThe answer is 4.", "\nI should add.\n",
                  "The answer is 4.");
  expectReasoning(true, "I should add.</think>4", "I should add.", "4");  // <think> was in the prompt
  expectReasoning(true, "still thinking <th", "still thinking <th", "");  // cut off: all reasoning
  expectReasoning(false, "No thinking here.", "", "No thinking here.");
  expectReasoning(false, "  <think>a</think>b", "a", "b");
  expectReasoning(false, "<thin", "", "<thin");
  expectReasoning(true, "a</thinkx</think>\n", "a</thinkx", "");
  expectReasoning(false, "<think>x</think>y</think>z", "x", "y</think>z");
}

TEST(ReasoningParser, ReportsWhetherItIsInsideReasoning) {
  ReasoningParser parser(false);
  EXPECT_FALSE(parser.inReasoning());
  (void)parser.feed("<think>hm");
  EXPECT_TRUE(parser.inReasoning());
  (void)parser.feed("</think>ok");
  EXPECT_FALSE(parser.inReasoning());
}

}  // namespace
}  // namespace pd::structured
