// The log's two formats: text lines as before plus key=value fields, and JSON mode where every
// line (plain or structured) is one JSON object that parses, whatever bytes a message holds.
#include <gtest/gtest.h>

#include <boost/json.hpp>
#include <limits>

#include "pd/common/log_format.h"

namespace pd::log {
namespace {

namespace json = boost::json;

constexpr std::int64_t kAt = 1764590612123;  // 2025-12-01T12:03:32.123Z

/// Restores the process-wide format after each test.
class LogFormat : public ::testing::Test {
 protected:
  void TearDown() override { setFormat(Format::Text); }
};

TEST_F(LogFormat, ParsesItsNames) {
  Format f = Format::Text;
  EXPECT_TRUE(parseFormat("json", &f));
  EXPECT_EQ(f, Format::Json);
  EXPECT_TRUE(parseFormat("text", &f));
  EXPECT_EQ(f, Format::Text);
  EXPECT_FALSE(parseFormat("JSON", &f));
  EXPECT_FALSE(parseFormat("", &f));
}

TEST_F(LogFormat, TextLinesKeepTheirShapeAndQuoteValuesThatCouldBreakThem) {
  setFormat(Format::Text);
  EXPECT_EQ(formatLine(kAt, Level::Info, "router", "serving"), "2025-12-01T12:03:32.123Z I [router] serving");
  const std::string line = formatLine(kAt, Level::Warn, "router", "request",
                                      {{"id", std::string("cmpl-1")},
                                       {"n", std::int64_t{7}},
                                       {"ms", 1.5},
                                       {"ok", true},
                                       {"who", std::string("a b\n\"c\"=d")}});
  EXPECT_EQ(line, R"(2025-12-01T12:03:32.123Z W [router] request id=cmpl-1 n=7 ms=1.500 ok=true who="a b\n\"c\"=d")");
  EXPECT_EQ(line.find('\n'), std::string::npos);
}

TEST_F(LogFormat, JsonLinesAreOneObjectWithTheFieldsAsMembers) {
  setFormat(Format::Json);
  const std::string line = formatLine(
      kAt, Level::Info, "router", "request",
      {{"id", std::string("cmpl-1")}, {"prompt_tokens", std::int64_t{12}}, {"ttft_ms", 3.25}, {"stream", false}});
  const json::object o = json::parse(line).as_object();
  EXPECT_EQ(o.at("ts").as_string(), "2025-12-01T12:03:32.123Z");
  EXPECT_EQ(o.at("level").as_string(), "info");
  EXPECT_EQ(o.at("component").as_string(), "router");
  EXPECT_EQ(o.at("msg").as_string(), "request");
  EXPECT_EQ(o.at("id").as_string(), "cmpl-1");
  EXPECT_EQ(o.at("prompt_tokens").as_int64(), 12);
  EXPECT_DOUBLE_EQ(o.at("ttft_ms").as_double(), 3.25);
  EXPECT_FALSE(o.at("stream").as_bool());
  // A plain message in JSON mode too.
  EXPECT_EQ(json::parse(formatLine(kAt, Level::Error, "x", "plain")).at("level").as_string(), "error");
}

TEST_F(LogFormat, HostileBytesStayInsideTheJsonString) {
  setFormat(Format::Json);
  std::string nasty = "quote\" backslash\\ newline\n nul";
  nasty.push_back('\0');
  nasty += " ctl\x01 del\x7f bad\xff\xc0\x80 cut\xe2\x82 ok\xe2\x82\xac";
  const std::string line = formatLine(kAt, Level::Info, "c\"omp", nasty, {{"k", nasty}});
  EXPECT_EQ(line.find('\n'), std::string::npos);
  boost::system::error_code ec;
  const json::value v = json::parse(line, ec);
  ASSERT_FALSE(ec) << line;
  const std::string msg(v.at("msg").as_string());
  EXPECT_NE(msg.find("quote\" backslash\\ newline\n nul"), std::string::npos);
  EXPECT_NE(msg.find("ok\xe2\x82\xac"), std::string::npos);   // valid UTF-8 (the euro sign) is kept
  EXPECT_NE(msg.find("bad\xef\xbf\xbd"), std::string::npos);  // 0xff became U+FFFD
  EXPECT_EQ(v.at("component").as_string(), "c\"omp");
  EXPECT_EQ(v.at("k").as_string(), v.at("msg").as_string());
}

TEST_F(LogFormat, NonFiniteNumbersAreNull) {
  setFormat(Format::Json);
  const json::value v =
      json::parse(formatLine(kAt, Level::Info, "c", "m", {{"x", std::numeric_limits<double>::infinity()}}));
  EXPECT_TRUE(v.at("x").is_null());
}

}  // namespace
}  // namespace pd::log
