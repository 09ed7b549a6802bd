// W3C traceparent: the strict parser against valid, malformed and hostile headers, and ids.
#include <gtest/gtest.h>

#include <random>
#include <set>
#include <string>

#include "pd/trace/sampler.h"
#include "pd/trace/trace_context.h"

namespace pd::trace {
namespace {

constexpr std::string_view kValid = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

TEST(Traceparent, ParsesTheSpecificationExample) {
  auto ctx = parseTraceparent(kValid);
  ASSERT_TRUE(ctx.has_value());
  EXPECT_EQ(ctx->trace_id.hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
  EXPECT_EQ(ctx->span_id.hex(), "00f067aa0ba902b7");
  EXPECT_TRUE(ctx->sampled());
  EXPECT_EQ(formatTraceparent(*ctx), kValid);
}

TEST(Traceparent, RoundTripsUnsampledAndAllowsSurroundingWhitespace) {
  auto ctx = parseTraceparent(" \t00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00 ");
  ASSERT_TRUE(ctx.has_value());
  EXPECT_FALSE(ctx->sampled());
  EXPECT_EQ(parseTraceparent(formatTraceparent(*ctx)), ctx);
}

TEST(Traceparent, RejectsMalformedHeaders) {
  const std::vector<std::string> bad = {
      "",
      "00",
      "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0",                     // short
      "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-",                   // 00 has no extra fields
      "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",                   // trailing byte
      "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",                    // upper case
      "00-00000000000000000000000000000000-00f067aa0ba902b7-01",                    // zero trace id
      "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",                    // zero span id
      "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",                    // version ff
      "0x-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",                    // bad version
      "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",                    // bad separator
      "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",                    // non-hex
      "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-zz",                    // bad flags
      "00-4bf92f3577b34da6a3ce929d0e0e47-3600f067aa0ba902b7-01",                    // shifted dash
      "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",                   // future version: '-' must follow
      std::string("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0\0", 55),  // NUL
  };
  for (const auto& header : bad) EXPECT_FALSE(parseTraceparent(header).has_value()) << header;
}

TEST(Traceparent, ReadsTheKnownFieldsOfAFutureVersion) {
  auto ctx = parseTraceparent("cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-ever");
  ASSERT_TRUE(ctx.has_value());
  EXPECT_EQ(ctx->span_id.hex(), "00f067aa0ba902b7");
}

// Hostile input never crashes: random bytes, and random single-byte mutations of a valid header
// (each either parses to a valid context or is rejected).
TEST(Traceparent, SurvivesRandomAndMutatedInput) {
  std::mt19937 rng(20261201);
  std::uniform_int_distribution<int> byte(0, 255);
  int accepted = 0;
  for (int i = 0; i < 20000; ++i) {
    std::string s;
    if (i % 2 == 0) {
      s.resize(static_cast<std::size_t>(rng() % 80));
      for (char& c : s) c = static_cast<char>(byte(rng));
    } else {
      s = std::string(kValid);
      s[rng() % s.size()] = static_cast<char>(byte(rng));
      if (rng() % 4 == 0) s.resize(rng() % (s.size() + 10), '-');
    }
    auto ctx = parseTraceparent(s);
    if (ctx) {
      ++accepted;
      EXPECT_TRUE(ctx->valid());
      EXPECT_EQ(formatTraceparent(*ctx).size(), 55u);
    }
  }
  EXPECT_GT(accepted, 0);  // some mutations (e.g. of a hex digit) stay valid
}

TEST(Ids, AreRandomAndNeverZero) {
  std::set<std::string> seen;
  for (int i = 0; i < 1000; ++i) {
    const TraceId t = newTraceId();
    const SpanId s = newSpanId();
    ASSERT_TRUE(t.valid());
    ASSERT_TRUE(s.valid());
    seen.insert(t.hex());
    seen.insert(s.hex());
  }
  EXPECT_EQ(seen.size(), 2000u);
  EXPECT_FALSE(parseTraceId("00000000000000000000000000000000").has_value());
  EXPECT_FALSE(parseSpanId("00F067AA0BA902B7").has_value());
  EXPECT_EQ(parseSpanId("00f067aa0ba902b7")->hex(), "00f067aa0ba902b7");
}

TEST(Sampler, FollowsTheParentAndTheRatio) {
  const auto parent = parseTraceparent(kValid);
  auto unsampled = *parent;
  unsampled.flags = 0;
  const Sampler never(0.0);
  const Sampler always(1.0);
  EXPECT_TRUE(never.shouldSample(parent, parent->trace_id));
  EXPECT_FALSE(always.shouldSample(unsampled, parent->trace_id));
  EXPECT_TRUE(always.shouldSample(std::nullopt, newTraceId()));
  EXPECT_FALSE(never.shouldSample(std::nullopt, newTraceId()));

  // The decision is a function of the trace id's low 8 bytes.
  TraceId low;
  low.bytes[15] = 1;
  TraceId high;
  high.bytes.fill(0xff);
  const Sampler quarter(0.25);
  EXPECT_TRUE(quarter.shouldSample(std::nullopt, low));
  EXPECT_FALSE(quarter.shouldSample(std::nullopt, high));
  int sampled = 0;
  for (int i = 0; i < 4000; ++i) sampled += quarter.shouldSample(std::nullopt, newTraceId()) ? 1 : 0;
  EXPECT_GT(sampled, 800);  // 1000 expected; 800..1200 is over 7 standard deviations wide
  EXPECT_LT(sampled, 1200);
}

}  // namespace
}  // namespace pd::trace
