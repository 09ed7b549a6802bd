// Per-API-key limits (key_limits.h): concurrency slots, the exact 60-second token window with
// reservations corrected at the end, and the Retry-After arithmetic, on a fake clock.
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "pd/router/key_limits.h"

namespace pd::router {
namespace {

using namespace std::chrono_literals;
using Refusal = KeyLimiter::Refusal;

class FakeClock {
 public:
  KeyLimiter::Clock::time_point now() const { return now_; }
  void advance(std::chrono::milliseconds d) { now_ += d; }

 private:
  KeyLimiter::Clock::time_point now_{std::chrono::hours(1000)};
};

class KeyLimiterTest : public ::testing::Test {
 protected:
  std::unique_ptr<KeyLimiter> limiter(std::vector<KeyLimits> limits) {
    return std::make_unique<KeyLimiter>(std::move(limits), [this] { return clock_.now(); });
  }
  FakeClock clock_;
};

TEST_F(KeyLimiterTest, ConcurrencySlotsAreHeldUntilTheLeaseEnds) {
  auto l = limiter({KeyLimits{.max_concurrent = 2}});
  auto a = l->admit(0, 10);
  auto b = l->admit(0, 10);
  ASSERT_TRUE(a.lease && b.lease);
  auto c = l->admit(0, 10);
  ASSERT_FALSE(c.lease);
  EXPECT_EQ(c.refusal, Refusal::Concurrent);
  EXPECT_FALSE(c.retry_after.has_value()) << "the end of a request cannot be foreseen";
  EXPECT_NE(c.message.find("2 request(s) in flight"), std::string::npos) << c.message;
  EXPECT_EQ(l->usage(0).in_flight, 2);

  a.lease->finish(5);
  EXPECT_EQ(l->usage(0).in_flight, 1);
  a.lease->finish(5);  // only the first call counts
  EXPECT_EQ(l->usage(0).in_flight, 1);
  auto d = l->admit(0, 10);
  ASSERT_TRUE(d.lease);
  // A lease dropped without finish() frees its slot too; a moved-from one frees nothing.
  KeyLimiter::Lease moved = std::move(*d.lease);
  d.lease.reset();
  EXPECT_EQ(l->usage(0).in_flight, 2);
  { KeyLimiter::Lease gone = std::move(moved); }
  EXPECT_EQ(l->usage(0).in_flight, 1);
  b.lease.reset();
  EXPECT_EQ(l->usage(0).in_flight, 0);
}

TEST_F(KeyLimiterTest, KeysWithoutLimitsAndUnknownKeysAreNotCounted) {
  auto l = limiter({KeyLimits{}, KeyLimits{.max_concurrent = 1}});
  std::vector<KeyLimiter::Lease> held;
  for (int i = 0; i < 100; ++i) {
    auto a = l->admit(0, 1'000'000);
    ASSERT_TRUE(a.lease);
    held.push_back(std::move(*a.lease));
    auto u = l->admit(7, 1'000'000);  // out of range: authentication off or a key without an entry
    ASSERT_TRUE(u.lease);
  }
  EXPECT_EQ(l->usage(0).in_flight, 0);
  auto one = l->admit(1, 1);
  ASSERT_TRUE(one.lease);
  EXPECT_FALSE(l->admit(1, 1).lease) << "key 1's limit is its own";
}

TEST_F(KeyLimiterTest, TokenWindowReservesAtAdmissionAndCorrectsAtTheEnd) {
  auto l = limiter({KeyLimits{.tokens_per_minute = 1000}});
  auto a = l->admit(0, 600);  // e.g. prompt 100 + max_tokens 500
  ASSERT_TRUE(a.lease);
  EXPECT_EQ(l->usage(0).window_tokens, 600);
  auto b = l->admit(0, 500);
  ASSERT_FALSE(b.lease) << "600 + 500 > 1000 while the first request may still use its reservation";
  EXPECT_EQ(b.refusal, Refusal::Tokens);
  ASSERT_TRUE(b.retry_after.has_value());
  EXPECT_EQ(*b.retry_after, 60s) << "the only reservation leaves the window a minute after it was made";

  clock_.advance(10s);
  a.lease->finish(150);  // it used 150: the window keeps 150, stamped at its admission
  EXPECT_EQ(l->usage(0).window_tokens, 150);
  auto c = l->admit(0, 850);
  ASSERT_TRUE(c.lease) << "exactly the limit fits";
  EXPECT_EQ(l->usage(0).window_tokens, 1000);
  auto d = l->admit(0, 1);
  ASSERT_FALSE(d.lease);
  // The first reservation (150) leaves 50 s from now; that is enough room for 1 token.
  EXPECT_EQ(*d.retry_after, 50s);
  auto e = l->admit(0, 200);
  ASSERT_FALSE(e.lease);
  // 200 needs the second reservation (850, made now) gone as well: 60 s.
  EXPECT_EQ(*e.retry_after, 60s);
  EXPECT_NE(e.message.find("used 1000 of its 1000 tokens per minute"), std::string::npos) << e.message;

  clock_.advance(50s);  // the first reservation leaves the window exactly now
  EXPECT_EQ(l->usage(0).window_tokens, 850);
  auto f = l->admit(0, 150);
  ASSERT_TRUE(f.lease);
  auto g = l->admit(0, 1);
  ASSERT_FALSE(g.lease);
  EXPECT_EQ(*g.retry_after, 10s);

  // Retry-After rounds a partial second up and is never 0.
  clock_.advance(9500ms);
  auto h = l->admit(0, 1);
  ASSERT_FALSE(h.lease);
  EXPECT_EQ(*h.retry_after, 1s);
  clock_.advance(499ms);
  auto i = l->admit(0, 1);
  ASSERT_FALSE(i.lease);
  EXPECT_EQ(*i.retry_after, 1s);
  clock_.advance(1ms);
  EXPECT_TRUE(l->admit(0, 1).lease) << "c's 850 left the window";
}

TEST_F(KeyLimiterTest, CorrectionAfterTheWindowAndOverUseAreHarmless) {
  auto l = limiter({KeyLimits{.tokens_per_minute = 100}});
  auto a = l->admit(0, 80);
  ASSERT_TRUE(a.lease);
  clock_.advance(61s);
  EXPECT_EQ(l->usage(0).window_tokens, 0);
  auto b = l->admit(0, 90);
  ASSERT_TRUE(b.lease);
  a.lease->finish(10);  // its reservation left the window: nothing to correct, b's stays whole
  EXPECT_EQ(l->usage(0).window_tokens, 90);
  b.lease->finish(500);  // never more than reserved (the reservation is the most it may use)
  EXPECT_EQ(l->usage(0).window_tokens, 90);
  auto c = l->admit(0, 10);
  ASSERT_TRUE(c.lease);
  c.lease->finish(-3);  // clamped to 0
  EXPECT_EQ(l->usage(0).window_tokens, 90);
}

TEST_F(KeyLimiterTest, AReservationLargerThanTheLimitIsTooLargeWithoutRetryAfter) {
  auto l = limiter({KeyLimits{.max_concurrent = 3, .tokens_per_minute = 100}});
  auto a = l->admit(0, 101);
  ASSERT_FALSE(a.lease);
  EXPECT_EQ(a.refusal, Refusal::TooLarge);
  EXPECT_FALSE(a.retry_after.has_value());
  EXPECT_NE(a.message.find("reserves 101 tokens"), std::string::npos) << a.message;
  EXPECT_EQ(l->usage(0).in_flight, 0);
  EXPECT_EQ(l->usage(0).window_tokens, 0);
}

TEST_F(KeyLimiterTest, BothLimitsApplyAndARefusalTakesNothing) {
  auto l = limiter({KeyLimits{.max_concurrent = 1, .tokens_per_minute = 100}});
  auto a = l->admit(0, 60);
  ASSERT_TRUE(a.lease);
  auto b = l->admit(0, 10);
  ASSERT_FALSE(b.lease);
  EXPECT_EQ(b.refusal, Refusal::Concurrent);
  a.lease->finish(60);
  auto c = l->admit(0, 50);
  ASSERT_FALSE(c.lease);
  EXPECT_EQ(c.refusal, Refusal::Tokens);
  EXPECT_EQ(l->usage(0).in_flight, 0);
  EXPECT_EQ(l->usage(0).window_tokens, 60);
  EXPECT_TRUE(l->admit(0, 40).lease);
}

}  // namespace
}  // namespace pd::router
