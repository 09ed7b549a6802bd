// TransferId: 128 random bits, a canonical text form, and a parser that refuses hostile text.

#include <gtest/gtest.h>

#include <string>
#include <unordered_set>

#include "pd/kvtransfer/transfer_id.h"

namespace pd::kvtransfer {
namespace {

TEST(TransferId, TextFormIsThirtyTwoLowercaseHexDigitsHighHalfFirst) {
  const TransferId id{0x0123456789abcdefULL, 0xfedcba9876543210ULL};
  EXPECT_EQ(id.hex(), "0123456789abcdeffedcba9876543210");
  EXPECT_EQ(TransferId{}.hex(), std::string(32, '0'));
  EXPECT_EQ((TransferId{0, 1}.hex()), "00000000000000000000000000000001");
  const auto back = TransferId::fromHex(id.hex());
  ASSERT_TRUE(back.ok()) << back.error().toString();
  EXPECT_EQ(back.value(), id);
  EXPECT_EQ(TransferId::fromHex("ffffffffffffffffffffffffffffffff").value(), (TransferId{~0ULL, ~0ULL}));
}

TEST(TransferId, HostileTextIsRefused) {
  const std::string good = "0123456789abcdeffedcba9876543210";
  const std::vector<std::string> bad = {
      "",
      good.substr(1),                                        // 31 digits
      good + "0",                                            // 33 digits
      "0123456789ABCDEFFEDCBA9876543210",                    // uppercase: one id, one text form
      "0123456789abcdeffedcba987654321g",                    // not a hex digit
      "0x23456789abcdeffedcba9876543210",                    // no prefix
      " 123456789abcdeffedcba9876543210",                    // no padding
      "-123456789abcdeffedcba9876543210",                    // no sign
      std::string("0123456789abcdef\0edcba9876543210", 32),  // an embedded NUL
      std::string(4096, 'a'),
  };
  for (const auto& text : bad) {
    const auto r = TransferId::fromHex(text);
    ASSERT_FALSE(r.ok()) << "accepted '" << text << "'";
    EXPECT_EQ(r.error().code, ErrorCode::InvalidArgument);
  }
}

TEST(TransferId, RandomIdsAreDistinctNonZeroAndUseBothHalves) {
  std::unordered_set<TransferId> seen;
  bool hi_set = false;
  bool lo_set = false;
  for (int i = 0; i < 1000; ++i) {
    const TransferId id = TransferId::random();
    EXPECT_NE(id, TransferId{});
    EXPECT_TRUE(seen.insert(id).second) << "a repeated 128-bit id: " << id.hex();
    // With uniform bits, a half above 2^63 turns up about every other draw.
    hi_set = hi_set || id.hi > (1ULL << 63);
    lo_set = lo_set || id.lo > (1ULL << 63);
  }
  EXPECT_TRUE(hi_set && lo_set);
}

TEST(TransferId, OrderAndEqualityCoverBothHalves) {
  EXPECT_NE((TransferId{1, 2}), (TransferId{1, 3}));
  EXPECT_NE((TransferId{1, 2}), (TransferId{2, 2}));
  EXPECT_LT((TransferId{1, ~0ULL}), (TransferId{2, 0}));
  EXPECT_NE(TransferIdHash{}(TransferId{1, 2}), TransferIdHash{}(TransferId{2, 1}));
}

}  // namespace
}  // namespace pd::kvtransfer
