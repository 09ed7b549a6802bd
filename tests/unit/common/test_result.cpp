#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "pd/common/result.h"

namespace {

pd::Result<int> parsePositive(int v) {
  if (v <= 0) return pd::makeError(pd::ErrorCode::InvalidArgument, "not positive: " + std::to_string(v));
  return v;
}

pd::Result<int> doubled(int v) {
  PD_ASSIGN_OR_RETURN(int x, parsePositive(v));
  return 2 * x;
}

pd::Status checkBoth(int a, int b) {
  PD_TRY(parsePositive(a));
  PD_TRY(parsePositive(b));
  return pd::okStatus();
}

TEST(Result, ValueAndErrorPropagate) {
  auto good = doubled(4);
  ASSERT_TRUE(good.ok());
  EXPECT_EQ(good.value(), 8);
  auto bad = doubled(-1);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().code, pd::ErrorCode::InvalidArgument);
  EXPECT_EQ(bad.error().toString(), "InvalidArgument: not positive: -1");
  EXPECT_TRUE(checkBoth(1, 2).ok());
  EXPECT_EQ(checkBoth(1, 0).error().message, "not positive: 0");
}

TEST(Result, HoldsMoveOnlyValues) {
  pd::Result<std::unique_ptr<int>> r(std::make_unique<int>(7));
  ASSERT_TRUE(r.ok());
  std::unique_ptr<int> p = std::move(r).value();
  EXPECT_EQ(*p, 7);
}

TEST(ResultDeathTest, ValueOfErrorAborts) {
  pd::Result<int> r = pd::makeError(pd::ErrorCode::Internal, "x");
  EXPECT_DEATH({ (void)r.value(); }, "PD_CHECK failed");
}

}  // namespace
