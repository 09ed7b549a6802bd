// The grammar engine on a hand-made byte vocabulary: exact acceptance, the stop rule, whitespace
// bounds, UTF-8 across tokens, rollback, and the errors that name unsupported schema features.

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "grammar_test_support.h"
#include "pd/structured/grammar.h"

namespace pd::structured {
namespace {

using testing::allowed;
using testing::byteVocabulary;
using testing::countAllowed;

std::shared_ptr<const Grammar> compile(const std::string& schema, const std::shared_ptr<const TokenVocabulary>& vocab,
                                       GrammarOptions options = {}) {
  auto g = Grammar::fromJsonSchema(schema, vocab, options);
  EXPECT_TRUE(g.ok()) << schema << ": " << g.error().toString();
  return g.ok() ? std::move(g).value() : nullptr;
}

// Feeds `text` one byte token at a time; false at the first byte the grammar refuses.
bool feedBytes(Matcher& m, std::string_view text) {
  for (const char c : text) {
    if (!m.accept(static_cast<TokenId>(static_cast<unsigned char>(c))).ok()) return false;
  }
  return true;
}

bool accepts(const std::string& schema, std::string_view text, GrammarOptions options = {}) {
  auto vocab = byteVocabulary();
  Matcher m(compile(schema, vocab, options));
  return feedBytes(m, text) && m.isComplete();
}

constexpr const char* kPerson =
    R"({"type":"object","properties":{"name":{"type":"string","maxLength":5},"age":{"type":"integer"}},)"
    R"("required":["name"],"additionalProperties":false})";

TEST(Grammar, AcceptsExactlyTheSchemasValues) {
  EXPECT_TRUE(accepts(kPerson, R"({"name":"Al","age":3})"));
  EXPECT_TRUE(accepts(kPerson, R"({"name":"Al"})"));
  EXPECT_TRUE(accepts(kPerson, R"({ "name": "Al", "age": -30 })"));
  EXPECT_FALSE(accepts(kPerson, R"({"age":3,"name":"Al"})")) << "properties come in schema order";
  EXPECT_FALSE(accepts(kPerson, R"({"age":3})")) << "name is required";
  EXPECT_FALSE(accepts(kPerson, R"({"name":"Alberto"})")) << "maxLength 5";
  EXPECT_FALSE(accepts(kPerson, R"({"name":"Al","x":1})")) << "no unlisted properties";
  EXPECT_FALSE(accepts(kPerson, R"({"name":"Al",})")) << "no trailing comma";
  EXPECT_FALSE(accepts(kPerson, R"({"name":"Al","age":1.5})")) << "integer";
  EXPECT_FALSE(accepts(kPerson, R"({"name":"Al","age":01})")) << "no leading zero";
  EXPECT_TRUE(accepts(R"({"type":"number"})", "-0.5e+12"));
  EXPECT_FALSE(accepts(R"({"type":"number"})", "1e123")) << "at most 2 exponent digits";
  EXPECT_TRUE(accepts(R"({"type":"array","items":{"type":"boolean"},"minItems":1,"maxItems":2})", "[true,false]"));
  EXPECT_FALSE(accepts(R"({"type":"array","items":{"type":"boolean"},"minItems":1,"maxItems":2})", "[]"));
  EXPECT_FALSE(accepts(R"({"type":"array","items":{"type":"boolean"},"minItems":1,"maxItems":2})", "[true,true,true]"));
  EXPECT_TRUE(accepts(R"({"enum":["a",1,null,{"k":[true]}]})", R"({"k":[true]})"));
  EXPECT_FALSE(accepts(R"({"enum":["a",1]})", R"("b")"));
  EXPECT_TRUE(accepts(R"({"const":"x\"y"})", R"("x\"y")"));
  EXPECT_TRUE(accepts(R"({"anyOf":[{"type":"integer"},{"type":"null"}]})", "null"));
  EXPECT_TRUE(accepts(R"({"type":"string"})", R"("a\n\u00e9\"\\")"));
  EXPECT_FALSE(accepts(R"({"type":"string"})", "\"a\nb\"")) << "raw control character";
  EXPECT_FALSE(accepts(R"({"type":"string"})", R"("\ud800")")) << "lone surrogate escape";
  EXPECT_TRUE(accepts(R"({"type":"string","pattern":"^[a-c]+x?$"})", R"("abcx")"));
  EXPECT_FALSE(accepts(R"({"type":"string","pattern":"^[a-c]+x?$"})", R"("abd")"));
  EXPECT_TRUE(accepts(R"({"type":"string","pattern":"b+"})", R"("xxbyy")")) << "patterns are searched";
  EXPECT_TRUE(accepts(R"({"$defs":{"p":{"type":"integer"}},"type":"array","items":{"$ref":"#/$defs/p"}})", "[1,2]"));
  EXPECT_TRUE(accepts("{}", R"({"a":[1,{"b":null}],"c":"d"})"));
}

TEST(Grammar, AnyJsonObjectIsAnObject) {
  auto vocab = byteVocabulary();
  auto g = Grammar::anyJsonObject(vocab);
  ASSERT_TRUE(g.ok());
  Matcher m(g.value());
  EXPECT_TRUE(feedBytes(m, R"({"a":[1,2,{"b":"c"}],"d":{}})"));
  EXPECT_TRUE(m.isComplete());
  Matcher n(g.value());
  EXPECT_FALSE(feedBytes(n, "[1]"));
}

TEST(Grammar, StopTokenOnlyWhenComplete) {
  auto vocab = byteVocabulary();
  const TokenId stop = vocab->stopTokens()[0];
  Matcher m(compile(kPerson, vocab));
  std::vector<MaskWord> mask(vocab->maskWords());
  const std::string text = R"({"name":"Al"})";
  for (std::size_t i = 0; i < text.size(); ++i) {
    m.fillMask(mask);
    EXPECT_FALSE(allowed(mask, stop)) << "after " << text.substr(0, i);
    EXPECT_FALSE(m.accept(stop).ok());
    ASSERT_TRUE(allowed(mask, static_cast<unsigned char>(text[i]))) << text.substr(0, i + 1);
    ASSERT_TRUE(m.accept(static_cast<unsigned char>(text[i])).ok());
  }
  m.fillMask(mask);
  EXPECT_TRUE(allowed(mask, stop));
  ASSERT_TRUE(m.accept(stop).ok());
  EXPECT_TRUE(m.isTerminated());
  m.fillMask(mask);
  EXPECT_EQ(countAllowed(mask), 1U);
  EXPECT_FALSE(m.accept('x').ok());
}

TEST(Grammar, WhitespaceIsBounded) {
  GrammarOptions two;
  two.max_whitespace = 2;
  EXPECT_TRUE(accepts(R"({"type":"array","items":{"type":"integer"}})", "[  1,  2  ]", two));
  EXPECT_FALSE(accepts(R"({"type":"array","items":{"type":"integer"}})", "[   1]", two));
  GrammarOptions none;
  none.max_whitespace = 0;
  EXPECT_FALSE(accepts(R"({"type":"array","items":{"type":"integer"}})", "[ 1]", none));
  EXPECT_TRUE(accepts(R"({"type":"array","items":{"type":"integer"}})", "[1,2]", none));
  // After the value and its trailing whitespace only the stop token is left.
  auto vocab = byteVocabulary();
  Matcher m(compile(R"({"type":"integer"})", vocab, two));
  ASSERT_TRUE(feedBytes(m, "7  "));
  std::vector<MaskWord> mask(vocab->maskWords());
  m.fillMask(mask);
  EXPECT_EQ(countAllowed(mask), 1U);
  EXPECT_TRUE(allowed(mask, vocab->stopTokens()[0]));
}

TEST(Grammar, MultiByteCharactersAcrossTokens) {
  // 256: "é" whole; the byte tokens split it.
  auto vocab = byteVocabulary({"\xC3\xA9", "a\"}", "\"name\":\"", "\xE6\x97"});
  auto g =
      compile(R"({"type":"object","properties":{"name":{"type":"string","maxLength":2}},"required":["name"]})", vocab);
  Matcher m(g);
  std::vector<MaskWord> mask(vocab->maskWords());
  ASSERT_TRUE(m.accept('{').ok());
  ASSERT_TRUE(m.accept(258).ok()) << "a token spanning key, colon and the string's opening quote";
  m.fillMask(mask);
  EXPECT_TRUE(allowed(mask, 256));
  EXPECT_TRUE(allowed(mask, 0xC3));
  EXPECT_FALSE(allowed(mask, 0xC0)) << "overlong lead byte";
  EXPECT_FALSE(allowed(mask, 0x80)) << "continuation byte without a lead";
  EXPECT_FALSE(allowed(mask, 0xF5));
  ASSERT_TRUE(m.accept(0xC3).ok());
  m.fillMask(mask);
  EXPECT_TRUE(allowed(mask, 0xA9));
  EXPECT_FALSE(allowed(mask, 'a')) << "a character is incomplete";
  EXPECT_FALSE(allowed(mask, 0xC3));
  ASSERT_TRUE(m.accept(0xA9).ok());
  ASSERT_TRUE(m.accept(259).ok()) << "the first two bytes of a three-byte character";
  m.fillMask(mask);
  EXPECT_TRUE(allowed(mask, 0xA5));
  EXPECT_FALSE(allowed(mask, '"'));
  ASSERT_TRUE(m.accept(0xA5).ok());
  m.fillMask(mask);
  EXPECT_FALSE(allowed(mask, 256)) << "maxLength 2 reached";
  EXPECT_FALSE(allowed(mask, 257)) << "\"a\\\"}\" would be a third character";
  EXPECT_TRUE(allowed(mask, '"'));
  // Surrogates never: ED A0 would start U+D800.
  Matcher s(compile(R"({"type":"string"})", vocab));
  ASSERT_TRUE(feedBytes(s, "\"\xED"));
  s.fillMask(mask);
  EXPECT_TRUE(allowed(mask, 0x9F));
  EXPECT_FALSE(allowed(mask, 0xA0));
}

TEST(Grammar, RollbackRestoresTheMask) {
  auto vocab = byteVocabulary({"\"name\":\"", "ab", "\"}"});
  Matcher m(compile(kPerson, vocab));
  std::vector<MaskWord> before(vocab->maskWords());
  std::vector<MaskWord> after(vocab->maskWords());
  ASSERT_TRUE(m.accept('{').ok());
  m.fillMask(before);
  ASSERT_TRUE(m.accept(256).ok());
  ASSERT_TRUE(m.accept(257).ok());
  ASSERT_TRUE(m.accept(258).ok());
  EXPECT_TRUE(m.isComplete());
  ASSERT_TRUE(m.accept(vocab->stopTokens()[0]).ok());
  EXPECT_EQ(m.acceptedCount(), 5U);
  m.rollback(4);
  EXPECT_EQ(m.acceptedCount(), 1U);
  EXPECT_FALSE(m.isTerminated());
  m.fillMask(after);
  EXPECT_EQ(before, after);
  ASSERT_TRUE(m.accept(256).ok());
  EXPECT_FALSE(m.accept('\n').ok()) << "a refused token leaves the state as it was";
  ASSERT_TRUE(m.accept(257).ok());
}

void expectUnsupported(const std::string& schema, const std::string& names) {
  auto vocab = byteVocabulary();
  auto g = Grammar::fromJsonSchema(schema, vocab);
  ASSERT_FALSE(g.ok()) << schema;
  EXPECT_EQ(g.error().code, ErrorCode::Unsupported) << g.error().toString();
  EXPECT_NE(g.error().message.find(names), std::string::npos) << g.error().message << " should name " << names;
}

TEST(Grammar, UnsupportedFeaturesAreNamed) {
  expectUnsupported(R"({"type":"integer","minimum":3})", "'minimum'");
  expectUnsupported(R"({"oneOf":[{"type":"integer"}]})", "'oneOf'");
  expectUnsupported(R"({"allOf":[{"type":"integer"}]})", "'allOf'");
  expectUnsupported(R"({"type":"string","format":"date"})", "'format'");
  expectUnsupported(R"({"type":"object","patternProperties":{"a":{}}})", "'patternProperties'");
  expectUnsupported(R"({"type":"array","uniqueItems":true})", "'uniqueItems'");
  expectUnsupported(R"({"type":"array","items":[{"type":"integer"}]})", "tuples");
  expectUnsupported(R"({"type":"string","pattern":"(?=a)b"})", "(?=");
  expectUnsupported(R"({"type":"string","pattern":"\\D"})", "\\D");
  expectUnsupported(R"({"type":"string","pattern":"(a)\\1"})", "backreference");
  expectUnsupported(R"({"type":"string","pattern":"a^b"})", "'^'");
  expectUnsupported(R"({"$defs":{"n":{"type":"array","items":{"$ref":"#/$defs/n"}}},"$ref":"#/$defs/n"})",
                    "recursive $ref");
  expectUnsupported(R"({"$ref":"https://example.com/s.json"})", "https://example.com/s.json");
  expectUnsupported(R"({"type":"string","minLength":2,"pattern":"a+"})", "'minLength' together with 'pattern'");
}

TEST(Grammar, InvalidSchemasAreRefused) {
  auto vocab = byteVocabulary();
  for (const char* bad : {"{", R"({"type":"array","minItems":3,"maxItems":2})", R"({"type":"strng"})", R"({"enum":[]})",
                          R"({"type":"integer","enum":["a"]})", "false", R"({"type":"string","pattern":"[a-"})",
                          R"({"type":"string","maxLength":2,"pattern":"^abc$"})"}) {
    auto g = Grammar::fromJsonSchema(bad, vocab);
    ASSERT_FALSE(g.ok()) << bad;
    EXPECT_EQ(g.error().code, ErrorCode::InvalidArgument) << bad << ": " << g.error().toString();
  }
}

TEST(Grammar, PatternsWithClassesQuantifiersAndAlternation) {
  const std::string date = R"({"type":"string","pattern":"^\\d{4}-(0[1-9]|1[0-2])-\\d{2}$"})";
  EXPECT_TRUE(accepts(date, R"("2024-12-31")"));
  EXPECT_FALSE(accepts(date, R"("2024-13-31")"));
  EXPECT_FALSE(accepts(date, R"("24-12-31")"));
  const std::string word = R"({"type":"string","pattern":"^(?:[^\\s,]+)(, [^\\s,]+)*$","maxLength":20})";
  EXPECT_TRUE(accepts(word, R"("ab, cd, éf")"));
  EXPECT_FALSE(accepts(word, R"("ab,cd")"));
  const std::string dot = R"({"type":"string","pattern":"^a.c$"})";
  EXPECT_TRUE(accepts(dot,
                      "\"a\xE6\x97\xA5"
                      "c\""));
  EXPECT_FALSE(accepts(dot, R"("a\nc")"));
  EXPECT_TRUE(accepts(R"({"type":"string","pattern":"^x{2,3}$"})", R"("xxx")"));
  EXPECT_FALSE(accepts(R"({"type":"string","pattern":"^x{2,3}$"})", R"("xxxx")"));
  EXPECT_TRUE(accepts(R"({"type":"string","pattern":"^a\\.b$"})", R"("a.b")"));
  EXPECT_FALSE(accepts(R"({"type":"string","pattern":"^a\\.b$"})", R"("axb")"));
}

TEST(Grammar, PatternWithMaxLengthNeverStrandsTheString) {
  // "ab+c" fits in 4 characters only as "abbc" or shorter: after "xxab" the only way out is "c".
  auto vocab = byteVocabulary();
  Matcher m(compile(R"({"type":"string","pattern":"ab+c","maxLength":5})", vocab));
  ASSERT_TRUE(feedBytes(m, "\"xxab"));
  std::vector<MaskWord> mask(vocab->maskWords());
  m.fillMask(mask);
  EXPECT_EQ(countAllowed(mask), 1U);
  EXPECT_TRUE(allowed(mask, 'c'));
}

}  // namespace
}  // namespace pd::structured
namespace pd::structured {
namespace {
TEST(Grammar, NonAsciiPatterns) {
  EXPECT_TRUE(accepts(R"({"type":"string","pattern":"^(café|naïve|日本|😀)+$","maxLength":12})", "\"café\""));
  EXPECT_TRUE(accepts(R"({"type":"string","pattern":"^(café|x)+$"})", "\"café\""));
  EXPECT_TRUE(accepts(R"({"type":"string","pattern":"^(é)+$"})", "\"é\""));
  EXPECT_TRUE(accepts(R"({"type":"string","pattern":"^(café|naïve|日本|😀)+$","maxLength":12})", "\"😀\""));
  EXPECT_TRUE(accepts(R"({"type":"string","pattern":"^😀$"})", "\"😀\""));
  EXPECT_TRUE(accepts(R"({"type":"string","pattern":"^(cafe|x)+$"})", "\"cafe\""));
}
}  // namespace
}  // namespace pd::structured
namespace pd::structured {
namespace {
TEST(Grammar, UnboundedStringCap) {
  GrammarOptions cap;
  cap.unbounded_string_chars = 3;
  EXPECT_TRUE(accepts(R"({"type":"string"})", R"("abc")", cap));
  EXPECT_FALSE(accepts(R"({"type":"string"})", R"("abcd")", cap));
  EXPECT_TRUE(accepts(R"({"type":"string","maxLength":5})", R"("abcde")", cap)) << "maxLength wins";
  EXPECT_TRUE(accepts(R"({"type":"string","pattern":"^a{5}$"})", R"("aaaaa")", cap))
      << "never below the pattern's shortest";
  EXPECT_FALSE(accepts(R"({"type":"object"})", R"({"abcd":1})", cap)) << "map keys too";
  EXPECT_TRUE(accepts(R"({"type":"string"})", R"("abcdefgh")"));
}
}  // namespace
}  // namespace pd::structured
namespace pd::structured {
namespace {

// Byte tokens 0..255, the five tool-call markers as added tokens 256..260, the stop token 261.
const std::vector<std::string> kMarkers = {"<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                                           "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"};
constexpr TokenId kCallsBegin = 256;
constexpr TokenId kCallsEnd = 257;
constexpr TokenId kCallBegin = 258;
constexpr TokenId kCallEnd = 259;
constexpr TokenId kSep = 260;
constexpr TokenId kStop = 261;

std::shared_ptr<const TokenVocabulary> markerVocabulary() {
  std::vector<std::optional<std::string>> bytes;
  for (int b = 0; b < 256; ++b) bytes.emplace_back(std::string(1, static_cast<char>(b)));
  std::vector<std::pair<std::string, TokenId>> added;
  for (std::size_t i = 0; i < kMarkers.size(); ++i) {
    bytes.emplace_back(kMarkers[i]);  // the text is dropped: an added token is never text
    added.emplace_back(kMarkers[i], static_cast<TokenId>(256 + i));
  }
  auto vocab = TokenVocabulary::fromTokenBytes(std::move(bytes), kStop + 1, {kStop}, std::move(added));
  EXPECT_TRUE(vocab.ok());
  return std::move(vocab).value();
}

const std::vector<ToolSpec> kTools = {
    {"get_weather", R"({"type":"object","properties":{"city":{"type":"string"}},"required":["city"],)"
                    R"("additionalProperties":false})"},
    {"get_time", ""}};

bool acceptsTokens(Matcher& m, const std::vector<TokenId>& ids) {
  for (const TokenId t : ids) {
    if (!m.accept(t).ok()) return false;
  }
  return true;
}
std::vector<TokenId> bytesOf(std::string_view s) {
  std::vector<TokenId> ids;
  for (const char c : s) ids.push_back(static_cast<unsigned char>(c));
  return ids;
}
std::vector<TokenId> cat(std::initializer_list<std::vector<TokenId>> parts) {
  std::vector<TokenId> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

TEST(ToolCallGrammar, DeepSeekV3RequiredCall) {
  auto vocab = markerVocabulary();
  auto g = Grammar::forToolCalls(kTools, ToolCallFormat::DeepSeekV3, /*parallel=*/false, vocab);
  ASSERT_TRUE(g.ok()) << g.error().toString();
  Matcher m(g.value());
  std::vector<MaskWord> mask(vocab->maskWords());
  m.fillMask(mask);
  EXPECT_EQ(countAllowed(mask), 1U);
  EXPECT_TRUE(allowed(mask, kCallsBegin)) << "the section must start at once";
  const auto call = cat({{kCallsBegin, kCallBegin},
                         bytesOf("function"),
                         {kSep},
                         bytesOf("get_weather\n```json\n{\"city\": \"Oslo\"}\n```"),
                         {kCallEnd}});
  ASSERT_TRUE(acceptsTokens(m, call));
  m.fillMask(mask);
  EXPECT_EQ(countAllowed(mask), 1U);
  EXPECT_TRUE(allowed(mask, kCallsEnd)) << "one call only without parallel_tool_calls";
  ASSERT_TRUE(m.accept(kCallsEnd).ok());
  EXPECT_TRUE(m.isComplete());
  ASSERT_TRUE(m.accept(kStop).ok());

  Matcher bad_name(g.value());
  EXPECT_FALSE(
      acceptsTokens(bad_name, cat({{kCallsBegin, kCallBegin}, bytesOf("function"), {kSep}, bytesOf("rm_rf")})));
  Matcher bad_args(g.value());
  EXPECT_FALSE(acceptsTokens(
      bad_args,
      cat({{kCallsBegin, kCallBegin}, bytesOf("function"), {kSep}, bytesOf("get_weather\n```json\n{\"town\"")})));
  Matcher marker_text(g.value());
  EXPECT_FALSE(acceptsTokens(marker_text, bytesOf("<｜tool▁calls▁begin｜>"))) << "the marker's text is not the marker";
}

TEST(ToolCallGrammar, DeepSeekV31ParallelCalls) {
  auto vocab = markerVocabulary();
  auto g = Grammar::forToolCalls(kTools, ToolCallFormat::DeepSeekV31, /*parallel=*/true, vocab);
  ASSERT_TRUE(g.ok()) << g.error().toString();
  Matcher m(g.value());
  ASSERT_TRUE(acceptsTokens(m, cat({{kCallsBegin, kCallBegin},
                                    bytesOf("get_time"),
                                    {kSep},
                                    bytesOf("{}"),
                                    {kCallEnd},
                                    {kCallBegin},
                                    bytesOf("get_weather"),
                                    {kSep},
                                    bytesOf(R"({"city":"Rome"})"),
                                    {kCallEnd}})));
  std::vector<MaskWord> mask(vocab->maskWords());
  m.fillMask(mask);
  EXPECT_TRUE(allowed(mask, kCallBegin));
  EXPECT_TRUE(allowed(mask, kCallsEnd));
  EXPECT_FALSE(allowed(mask, kStop));
  ASSERT_TRUE(m.accept(kCallsEnd).ok());
  EXPECT_TRUE(m.isComplete());
  // A named function: only that one.
  const std::vector<ToolSpec> only = {kTools[1]};
  auto named = Grammar::forToolCalls(only, ToolCallFormat::DeepSeekV31, false, vocab);
  ASSERT_TRUE(named.ok());
  Matcher n(named.value());
  EXPECT_FALSE(acceptsTokens(n, cat({{kCallsBegin, kCallBegin}, bytesOf("get_weather")})));
}

TEST(ToolCallGrammar, RefusesWhatItCannotBuild) {
  auto no_markers = byteVocabulary();
  auto g = Grammar::forToolCalls(kTools, ToolCallFormat::DeepSeekV3, false, no_markers);
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.error().code, ErrorCode::Unsupported);
  const std::vector<ToolSpec> bad = {{"f", R"({"type":"object","properties":{"n":{"type":"integer","minimum":1}}})"}};
  auto b = Grammar::forToolCalls(bad, ToolCallFormat::DeepSeekV3, false, markerVocabulary());
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.error().message.find("tools[0].parameters"), std::string::npos) << b.error().message;
  EXPECT_NE(b.error().message.find("'minimum'"), std::string::npos) << b.error().message;
  EXPECT_FALSE(Grammar::forToolCalls({}, ToolCallFormat::DeepSeekV3, false, markerVocabulary()).ok());
}

}  // namespace
}  // namespace pd::structured
namespace pd::structured {
namespace {

TEST(Grammar, PatternStateMasksStayExactPastTheirCacheBound) {
  // Every 'a' moves the DFA to a new state: past the first 64 the masks come from the walk.
  auto vocab = byteVocabulary({"aa", "aaaa"});
  Matcher m(compile(R"({"type":"string","pattern":"^a{0,100}$"})", vocab));
  ASSERT_TRUE(m.accept('"').ok());
  std::vector<MaskWord> mask(vocab->maskWords());
  for (int i = 0; i < 100; ++i) {
    m.fillMask(mask);
    EXPECT_TRUE(allowed(mask, '"')) << i;
    EXPECT_TRUE(allowed(mask, 'a')) << i;
    EXPECT_EQ(allowed(mask, 256), i <= 98) << i;
    EXPECT_EQ(allowed(mask, 257), i <= 96) << i;
    EXPECT_EQ(countAllowed(mask), 2U + (i <= 98 ? 1U : 0U) + (i <= 96 ? 1U : 0U)) << i;
    ASSERT_TRUE(m.accept('a').ok());
  }
  m.fillMask(mask);
  EXPECT_EQ(countAllowed(mask), 1U);
  EXPECT_TRUE(allowed(mask, '"'));
}

}  // namespace
}  // namespace pd::structured
