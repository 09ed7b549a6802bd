#include <gtest/gtest.h>

#include <boost/json.hpp>
#include <random>
#include <string>

#include "pd/router/json_text.h"

namespace {

using pd::router::appendJsonString;
using pd::router::hasLoneSurrogateEscape;
using pd::router::isValidUtf8;
using pd::router::sanitizeUtf8;
using pd::router::Utf8StreamSanitizer;

const std::string kFffd = "\xEF\xBF\xBD";

TEST(Utf8, ValidatesPerRfc3629) {
  EXPECT_TRUE(isValidUtf8("plain ascii"));
  EXPECT_TRUE(isValidUtf8("h\xC3\xA9llo \xE2\x82\xAC \xF0\x9F\x98\x80 \xE4\xB8\xAD"));
  EXPECT_FALSE(isValidUtf8("\xC0\x80"));          // overlong NUL
  EXPECT_FALSE(isValidUtf8("\xE0\x80\xAF"));      // overlong '/'
  EXPECT_FALSE(isValidUtf8("\xED\xA0\x80"));      // encoded surrogate U+D800
  EXPECT_FALSE(isValidUtf8("\xF4\x90\x80\x80"));  // past U+10FFFF
  EXPECT_FALSE(isValidUtf8("\xE2\x82"));          // truncated
  EXPECT_FALSE(isValidUtf8("\xFF"));
  EXPECT_EQ(pd::router::firstInvalidUtf8("ab\xFF"), 2u);
}

TEST(Utf8, SanitizeReplacesEachMaximalSubpartOnce) {
  EXPECT_EQ(sanitizeUtf8("a\xFF"
                         "b"),
            "a" + kFffd + "b");
  EXPECT_EQ(sanitizeUtf8("\xE2\x82x"), kFffd + "x");         // truncated euro sign: one U+FFFD
  EXPECT_EQ(sanitizeUtf8("\xF0\x90\x80\x41"), kFffd + "A");  // valid 3-byte prefix, then 'A'
  EXPECT_EQ(sanitizeUtf8("\xC0\x80"), kFffd + kFffd);        // C0 is never valid, nor a lone 80
  EXPECT_EQ(sanitizeUtf8("\xED\xA0\x80"), kFffd + kFffd + kFffd);
  EXPECT_EQ(sanitizeUtf8("ok \xE2\x82"), "ok " + kFffd);  // cut at the end
}

TEST(Utf8, StreamSanitizerHoldsBackSplitCharacters) {
  Utf8StreamSanitizer s;
  EXPECT_EQ(s.push("a\xE2"), "a");
  EXPECT_EQ(s.push("\x82"), "");
  EXPECT_EQ(s.push("\xAC b"), "\xE2\x82\xAC b");
  EXPECT_EQ(s.push("\xF0\x9F"), "");
  EXPECT_EQ(s.finish(), kFffd);  // never completed
  EXPECT_EQ(s.finish(), "");
}

TEST(Utf8, StreamingEqualsWholeForAnySplit) {
  std::mt19937 rng(20261129);
  const std::string alphabet = "ab\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80\xFF\x80\xED\xA0";
  for (int round = 0; round < 2000; ++round) {
    std::string text;
    const int n = static_cast<int>(rng() % 24);
    for (int i = 0; i < n; ++i) text += alphabet[rng() % alphabet.size()];
    Utf8StreamSanitizer s;
    std::string streamed;
    std::size_t pos = 0;
    while (pos < text.size()) {
      const std::size_t len = 1 + rng() % 4;
      streamed += s.push(std::string_view(text).substr(pos, len));
      pos += len;
    }
    streamed += s.finish();
    ASSERT_EQ(streamed, sanitizeUtf8(text)) << "round " << round;
    ASSERT_TRUE(isValidUtf8(streamed));
  }
}

TEST(JsonText, DetectsLoneSurrogateEscapes) {
  EXPECT_FALSE(hasLoneSurrogateEscape(R"({"a":"\ud83d\ude00"})"));
  EXPECT_FALSE(hasLoneSurrogateEscape(R"({"a":"\u00e9 \\ud800"})"));  // an escaped backslash, then text
  EXPECT_TRUE(hasLoneSurrogateEscape(R"({"a":"\ud83d"})"));
  EXPECT_TRUE(hasLoneSurrogateEscape(R"({"a":"\ud83dx"})"));
  EXPECT_TRUE(hasLoneSurrogateEscape(R"({"a":"\ude00"})"));
  EXPECT_TRUE(hasLoneSurrogateEscape(R"({"a":"\uD800\u0041"})"));
}

TEST(JsonText, EscapedOutputAlwaysParsesBackToTheSanitizedText) {
  const std::string nasty = std::string("q\"uote\\ back\nnl\ttab\x01\x1F ctl \xFF bad \xE2\x82 cut \xF0\x9F\x98\x80");
  std::string out;
  appendJsonString(out, nasty);
  EXPECT_TRUE(isValidUtf8(out));
  boost::system::error_code ec;
  const auto v = boost::json::parse(out, ec);
  ASSERT_FALSE(ec) << out;
  EXPECT_EQ(std::string(v.as_string()), sanitizeUtf8(nasty));
  EXPECT_NE(out.find("\\u0001"), std::string::npos);
}

}  // namespace
