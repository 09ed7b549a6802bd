// OpenAI response_format / tool_choice -> ResponseConstraint, its worker-API round trip (and
// refusal of malformed input), compiling it, and the grammar cache.

#include <gtest/gtest.h>

#include <boost/json.hpp>
#include <string>

#include "grammar_test_support.h"
#include "pd/structured/response_constraint.h"

namespace pd::structured {
namespace {

using Kind = ResponseConstraint::Kind;

ResponseConstraint format(std::string_view json) {
  const auto v = boost::json::parse(json);
  auto c = responseFormatConstraint(&v);
  EXPECT_TRUE(c.ok()) << json << ": " << (c.ok() ? "" : c.error().message);
  return c.ok() ? std::move(c).value() : ResponseConstraint{};
}

std::string formatError(std::string_view json) {
  const auto v = boost::json::parse(json);
  auto c = responseFormatConstraint(&v);
  EXPECT_FALSE(c.ok()) << json;
  return c.ok() ? "" : c.error().message;
}

const char* kTools =
    R"([{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":)"
    R"({"city":{"type":"string"}},"required":["city"]}}},{"type":"function","function":{"name":"now"}}])";

Result<ResponseConstraint> choice(std::string_view tools, std::string_view tool_choice, bool parallel = true) {
  const auto t = boost::json::parse(tools);
  const auto c = boost::json::parse(tool_choice);
  return toolChoiceConstraint(&t, &c, parallel);
}

TEST(ResponseConstraint, FromResponseFormat) {
  EXPECT_EQ(responseFormatConstraint(nullptr)->kind, Kind::None);
  EXPECT_EQ(format(R"({"type":"text"})").kind, Kind::None);
  EXPECT_EQ(format(R"({"type":"json_object"})").kind, Kind::JsonObject);
  const auto s =
      format(R"({"type":"json_schema","json_schema":{"name":"x","strict":true,"schema":{"type":"integer"}}})");
  EXPECT_EQ(s.kind, Kind::JsonSchema);
  EXPECT_EQ(s.schema_json, R"({"type":"integer"})");
  EXPECT_NE(formatError(R"({"type":"xml"})").find("'response_format.type'"), std::string::npos);
  EXPECT_NE(formatError(R"({"type":"json_schema"})").find("'response_format.json_schema'"), std::string::npos);
  EXPECT_NE(formatError(R"({"type":"json_schema","json_schema":{"name":"x"}})").find("schema' is required"),
            std::string::npos);
  EXPECT_NE(formatError(R"({"type":"json_schema","json_schema":{"schema":{},"strict":"yes"}})").find("strict"),
            std::string::npos);
  EXPECT_NE(formatError(R"("json")").find("'response_format'"), std::string::npos);
}

TEST(ResponseConstraint, FromToolChoice) {
  EXPECT_EQ(choice(kTools, R"("auto")")->kind, Kind::None);
  EXPECT_EQ(choice(kTools, R"("none")")->kind, Kind::None);
  const auto required = choice(kTools, R"("required")", false);
  ASSERT_TRUE(required.ok());
  EXPECT_EQ(required->kind, Kind::ToolCalls);
  ASSERT_EQ(required->tools.size(), 2U);
  EXPECT_EQ(required->tools[0].name, "get_weather");
  EXPECT_EQ(required->tools[1].parameters_json, "");
  EXPECT_FALSE(required->parallel_tool_calls);
  const auto named = choice(kTools, R"({"type":"function","function":{"name":"now"}})");
  ASSERT_TRUE(named.ok());
  ASSERT_EQ(named->tools.size(), 1U);
  EXPECT_EQ(named->tools[0].name, "now");
  EXPECT_FALSE(named->parallel_tool_calls);
  EXPECT_NE(choice(kTools, R"({"type":"function","function":{"name":"rm"}})").error().message.find("does not define"),
            std::string::npos);
  EXPECT_NE(choice("[]", R"("required")").error().message.find("'tools' is empty"), std::string::npos);
  EXPECT_NE(choice(R"([{"type":"retrieval"}])", R"("auto")").error().message.find("'tools[0].type'"),
            std::string::npos);
  EXPECT_NE(choice(R"([{"type":"function","function":{"name":"a"}},{"type":"function","function":{"name":"a"}}])",
                   R"("required")")
                .error()
                .message.find("twice"),
            std::string::npos);
  EXPECT_NE(choice(kTools, R"("sometimes")").error().message.find("'tool_choice'"), std::string::npos);
}

TEST(ResponseConstraint, RoundTripsAndRefusesMalformed) {
  std::vector<ResponseConstraint> all(4);
  all[1].kind = Kind::JsonObject;
  all[2].kind = Kind::JsonSchema;
  all[2].schema_json = R"({"type":"string","pattern":"^a\"b$"})";
  all[3].kind = Kind::ToolCalls;
  all[3].tools = {{"f", R"({"type":"object"})"}, {"g", ""}};
  all[3].parallel_tool_calls = false;
  for (const auto& c : all) {
    auto back = decodeConstraint(encodeConstraint(c));
    ASSERT_TRUE(back.ok()) << encodeConstraint(c);
    EXPECT_EQ(back.value(), c) << encodeConstraint(c);
  }
  for (const char* bad : {"", "[]", R"({"kind":1})", R"({"kind":"regex"})", R"({"kind":"json_schema"})",
                          R"({"kind":"tool_calls","tools":[],"parallel_tool_calls":true})",
                          R"({"kind":"tool_calls","tools":[{"name":"f"}],"parallel_tool_calls":true})",
                          R"({"kind":"tool_calls","tools":[{"name":"f","parameters":""}]})"}) {
    auto r = decodeConstraint(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.error().code, ErrorCode::InvalidArgument);
  }
}

TEST(GrammarCache, CompilesOnceAndEvictsTheOldest) {
  GrammarCache cache(testing::byteVocabulary(), ToolCallFormat::DeepSeekV3, GrammarOptions{}, 2);
  ResponseConstraint a;
  a.kind = Kind::JsonSchema;
  a.schema_json = R"({"type":"integer"})";
  ResponseConstraint b = a;
  b.schema_json = R"({"type":"boolean"})";
  ResponseConstraint c;
  c.kind = Kind::JsonObject;
  auto ga = cache.get(a);
  ASSERT_TRUE(ga.ok());
  EXPECT_EQ(cache.get(a).value(), ga.value()) << "the same grammar, not a recompile";
  ASSERT_TRUE(cache.get(b).ok());
  ASSERT_TRUE(cache.get(a).ok());  // a is now the most recent
  ASSERT_TRUE(cache.get(c).ok());  // evicts b
  EXPECT_EQ(cache.size(), 2U);
  EXPECT_EQ(cache.get(a).value(), ga.value());
  ResponseConstraint bad = a;
  bad.schema_json = R"({"type":"integer","minimum":1})";
  auto err = cache.get(bad);
  ASSERT_FALSE(err.ok());
  EXPECT_EQ(err.error().code, ErrorCode::Unsupported);
  EXPECT_EQ(cache.size(), 2U) << "errors are not cached";
}

}  // namespace
}  // namespace pd::structured
