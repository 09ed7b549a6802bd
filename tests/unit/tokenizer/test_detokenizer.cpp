// Streaming detokenization: text is emitted as soon as it is final, never a U+FFFD that a later
// token completes, and the whole stream equals a full decode (golden prefixes of Hugging Face).
#include <gtest/gtest.h>

#include <random>

#include "pd/tokenizer/detokenizer.h"
#include "tokenizer_test_support.h"

namespace pd::tokenizer {
namespace {

using testing::idsOf;
using testing::readJsonl;
using testing::str;

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";

// The single-byte token of a byte.
TokenId byteId(const Tokenizer& tok, unsigned char want) {
  for (TokenId id = 0; id < 128000; ++id) {
    const auto bytes = tok.tokenBytes(id);
    if (bytes && bytes->size() == 1 && static_cast<unsigned char>((*bytes)[0]) == want) return id;
  }
  ADD_FAILURE() << "no token for byte " << int{want};
  return 0;
}

// Streams `ids` one at a time; checks every step against a full decode of the prefix.
void checkStream(const Tokenizer& tok, const std::vector<TokenId>& ids, bool skip_special) {
  IncrementalDetokenizer detok(tok, skip_special);
  const std::string full = tok.decode(ids, skip_special);
  std::string emitted;
  for (std::size_t k = 0; k < ids.size(); ++k) {
    emitted += detok.push(ids[k]);
    const std::string prefix = tok.decode(std::span(ids).first(k + 1), skip_special);
    // What the stream has emitted plus what it holds back is exactly the reference prefix...
    ASSERT_EQ(emitted + detok.peekRemainder(), prefix) << "after id " << k;
    // ...and what it emitted is final: a prefix of the whole decode.
    ASSERT_EQ(full.compare(0, emitted.size(), emitted), 0) << "emitted text changed later, after id " << k;
    ASSERT_LE(detok.pendingBytes(), 3u);
  }
  emitted += detok.finish();
  ASSERT_EQ(emitted, full);
  ASSERT_EQ(detok.pendingBytes(), 0u);
}

TEST(DetokenizerGolden, StreamingPrefixesMatchReference) {
  PD_REQUIRE_TOKENIZER(tok);
  int cases = 0;
  int steps = 0;
  for (const auto& c : readJsonl("decode_cases.jsonl")) {
    const auto ids = idsOf(c.at("ids"));
    checkStream(tok, ids, false);
    checkStream(tok, ids, true);
    if (const auto* prefix = c.if_contains("prefix_decoded")) {
      IncrementalDetokenizer detok(tok, false);
      std::string emitted;
      const auto& want = prefix->as_array();
      for (std::size_t k = 0; k < ids.size(); ++k) {
        emitted += detok.push(ids[k]);
        EXPECT_EQ(emitted + detok.peekRemainder(), str(want[k])) << "prefix " << k + 1;
        ++steps;
      }
      EXPECT_EQ(emitted + detok.finish(), str(c.at("decoded")));
    }
    ++cases;
  }
  EXPECT_EQ(cases, 26);
  EXPECT_EQ(steps, 29);
}

TEST(Detokenizer, HoldsBackIncompleteCharacters) {
  PD_REQUIRE_TOKENIZER(tok);
  // "😀" is F0 9F 98 80; feed its bytes as single-byte tokens.
  const std::string smile = "\xF0\x9F\x98\x80";
  std::vector<TokenId> ids;
  for (const char b : smile) ids.push_back(byteId(tok, static_cast<unsigned char>(b)));
  IncrementalDetokenizer detok(tok, false);
  EXPECT_EQ(detok.push(ids[0]), "");
  EXPECT_EQ(detok.peekRemainder(), kReplacement);  // what a decode of the prefix shows
  EXPECT_EQ(detok.push(ids[1]), "");
  EXPECT_EQ(detok.push(ids[2]), "");
  EXPECT_EQ(detok.pendingBytes(), 3u);
  EXPECT_EQ(detok.push(ids[3]), smile);
  EXPECT_EQ(detok.finish(), "");
}

TEST(Detokenizer, EmitsReplacementOnceNothingCanCompleteIt) {
  PD_REQUIRE_TOKENIZER(tok);
  const auto byte = [&](unsigned char b) { return byteId(tok, b); };
  IncrementalDetokenizer detok(tok, false);
  EXPECT_EQ(detok.push(byte(0xE2)), "");
  EXPECT_EQ(detok.push(byte(0x82)), "");
  // 'A' cannot continue E2 82: one U+FFFD for the two bytes, then 'A', all final now.
  EXPECT_EQ(detok.push(byte('A')), std::string(kReplacement) + "A");
  EXPECT_EQ(detok.push(byte(0xFF)), kReplacement);
  EXPECT_EQ(detok.finish(), "");
  // Ending on an incomplete sequence: finish() gives what the full decode gives.
  EXPECT_EQ(detok.push(byte(0xF0)), "");
  EXPECT_EQ(detok.finish(), kReplacement);
}

TEST(Detokenizer, SkipsSpecialAndUnknownIds) {
  PD_REQUIRE_TOKENIZER(tok);
  const auto hello = tok.encode("Hello").value();
  IncrementalDetokenizer skip(tok, true);
  EXPECT_EQ(skip.push(TokenId{0}), "");
  EXPECT_EQ(skip.push(std::span(hello)), "Hello");
  EXPECT_EQ(skip.push(TokenId{128804}), "<｜Assistant｜>");  // not special: kept
  EXPECT_EQ(skip.push(TokenId{1}), "");
  EXPECT_EQ(skip.push(TokenId{999999}), "");
  IncrementalDetokenizer keep(tok, false);
  EXPECT_EQ(keep.push(TokenId{1}), "<｜end▁of▁sentence｜>");
  EXPECT_EQ(keep.push(TokenId{128815}), "");
}

// Random id streams drawn from the whole vocabulary (many ids are partial UTF-8 alone).
TEST(Detokenizer, RandomStreamsEqualFullDecode) {
  PD_REQUIRE_TOKENIZER(tok);
  std::mt19937 rng(7);
  std::vector<TokenId> partial;  // tokens that are not valid UTF-8 alone
  for (TokenId id = 0; id < 128000; ++id) {
    const std::string bytes(tok.tokenBytes(id).value_or(""));
    if (tok.decode(std::vector<TokenId>{id}).find(kReplacement) != std::string::npos &&
        bytes.find(kReplacement) == std::string::npos) {
      partial.push_back(id);
    }
  }
  EXPECT_EQ(partial.size(), 1470u);  // meta.json: tokens_partial_utf8_alone
  for (int round = 0; round < 400; ++round) {
    std::vector<TokenId> ids;
    const int n = 1 + static_cast<int>(rng() % 24);
    for (int k = 0; k < n; ++k) {
      const auto pick = rng() % 3;
      ids.push_back(pick == 0 ? static_cast<TokenId>(rng() % 128815) : partial[rng() % partial.size()]);
    }
    checkStream(tok, ids, round % 2 == 0);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

}  // namespace
}  // namespace pd::tokenizer
