// The tokenizer against the golden data of Hugging Face `tokenizers` (tests/data/golden/tokenizer).
#include <gtest/gtest.h>

#include <random>
#include <thread>

#include "tokenizer_test_support.h"

namespace pd::tokenizer {
namespace {

using testing::idsOf;
using testing::readJsonl;
using testing::str;

int failureCount() {
  return ::testing::UnitTest::GetInstance()->current_test_info()->result()->total_part_count();
}

std::string hexOf(std::string_view bytes) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (const char c : bytes) {
    out.push_back(kHex[static_cast<unsigned char>(c) >> 4]);
    out.push_back(kHex[static_cast<unsigned char>(c) & 15]);
  }
  return out;
}

TEST(TokenizerFiles, PresentWithExpectedSha256) {
  const std::string problem = testing::checkTokenizerFiles();
  EXPECT_TRUE(problem.empty()) << problem;
}

TEST(TokenizerGolden, EncodeDecodeCases) {
  PD_REQUIRE_TOKENIZER(tok);
  const auto cases = readJsonl("cases.jsonl");
  ASSERT_EQ(cases.size(), 255u);
  int passed = 0;
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const auto& c = cases[i];
    const std::string text = str(c.at("text"));
    SCOPED_TRACE("cases.jsonl line " + std::to_string(i + 1) + " (" + str(c.at("category")) + ")");
    const auto want = idsOf(c.at("ids"));
    const int failures_before = failureCount();

    auto ids = tok.encode(text);
    ASSERT_TRUE(ids.ok()) << ids.error().toString();
    EXPECT_EQ(ids.value(), want);
    auto with_bos = tok.encode(text, /*add_special_tokens=*/true);
    ASSERT_TRUE(with_bos.ok());
    EXPECT_EQ(with_bos.value(), idsOf(c.at("ids_with_bos")));
    EXPECT_EQ(tok.decode(want), str(c.at("decoded")));
    EXPECT_EQ(tok.decode(want, /*skip_special_tokens=*/true), str(c.at("decoded_skip_special")));
    const auto& tokens = c.at("tokens").as_array();
    ASSERT_EQ(tokens.size(), want.size());
    for (std::size_t k = 0; k < want.size(); ++k) {
      EXPECT_EQ(tok.tokenString(want[k]).value_or("<none>"), str(tokens[k])) << "token " << k;
    }
    if (const auto* pretokens = c.if_contains("pretokens")) {
      auto pieces = tok.preTokenize(text);
      ASSERT_TRUE(pieces.ok());
      std::vector<std::string> got(pieces.value().begin(), pieces.value().end());
      std::vector<std::string> expected;
      for (const auto& p : pretokens->as_array()) expected.push_back(str(p));
      EXPECT_EQ(got, expected);
    }
    if (failureCount() == failures_before) ++passed;
  }
  EXPECT_EQ(passed, 255);
  std::printf("cases.jsonl: %d of %zu cases pass\n", passed, cases.size());
}

TEST(TokenizerGolden, DecodeCases) {
  PD_REQUIRE_TOKENIZER(tok);
  const auto cases = readJsonl("decode_cases.jsonl");
  ASSERT_EQ(cases.size(), 26u);
  int passed = 0;
  int prefixes = 0;
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const auto& c = cases[i];
    SCOPED_TRACE("decode_cases.jsonl line " + std::to_string(i + 1) + " (" + str(c.at("category")) + ")");
    const int failures_before = failureCount();
    const auto ids = idsOf(c.at("ids"));
    EXPECT_EQ(tok.decode(ids), str(c.at("decoded")));
    EXPECT_EQ(tok.decode(ids, true), str(c.at("decoded_skip_special")));
    std::string bytes;
    for (std::size_t k = 0; k < ids.size(); ++k) {
      bytes += std::string(tok.tokenBytes(ids[k]).value_or(""));
      EXPECT_EQ(tok.tokenString(ids[k]).value_or("<none>"), str(c.at("tokens").as_array()[k]));
    }
    EXPECT_EQ(hexOf(bytes), str(c.at("bytes_hex")));
    if (const auto* prefix = c.if_contains("prefix_decoded")) {
      const auto& want = prefix->as_array();
      ASSERT_EQ(want.size(), ids.size());
      for (std::size_t k = 1; k <= ids.size(); ++k) {
        EXPECT_EQ(tok.decode(std::span(ids).first(k)), str(want[k - 1])) << "prefix " << k;
        ++prefixes;
      }
    }
    if (const auto* per_id = c.if_contains("per_id_decoded")) {
      const auto& want = per_id->as_array();
      ASSERT_EQ(want.size(), ids.size());
      for (std::size_t k = 0; k < ids.size(); ++k) {
        EXPECT_EQ(tok.decode(std::span(ids).subspan(k, 1)), str(want[k])) << "id " << ids[k];
      }
    }
    if (failureCount() == failures_before) ++passed;
  }
  EXPECT_EQ(passed, 26);
  std::printf("decode_cases.jsonl: %d of %zu cases pass (%d streaming prefixes)\n", passed, cases.size(), prefixes);
}

TEST(Tokenizer, EmptyInput) {
  PD_REQUIRE_TOKENIZER(tok);
  EXPECT_EQ(tok.encode("").value(), std::vector<TokenId>{});
  EXPECT_EQ(tok.encode("", true).value(), std::vector<TokenId>{0});
  EXPECT_EQ(tok.decode({}), "");
  EXPECT_EQ(tok.preTokenize("").value().size(), 0u);
}

TEST(Tokenizer, InvalidUtf8IsRejectedWithOffset) {
  PD_REQUIRE_TOKENIZER(tok);
  for (const std::string& bad : {std::string("ab\xC3"), std::string("\xFF"), std::string("x\xED\xA0\x80y"),
                                 std::string("ok\xC0\xAF"), std::string("\xF4\x90\x80\x80")}) {
    auto ids = tok.encode(bad);
    ASSERT_FALSE(ids.ok());
    EXPECT_EQ(ids.error().code, ErrorCode::InvalidArgument);
    EXPECT_NE(ids.error().message.find("UTF-8"), std::string::npos) << ids.error().message;
  }
  EXPECT_NE(tok.encode("ab\xC3").error().message.find("byte offset 2"), std::string::npos);
}

TEST(Tokenizer, UnknownIdsAreDroppedByDecode) {
  PD_REQUIRE_TOKENIZER(tok);
  EXPECT_EQ(tok.vocabSize(), 128815u);
  EXPECT_FALSE(tok.isKnownId(128815));
  EXPECT_FALSE(tok.isKnownId(0xFFFFFFFFu));
  EXPECT_TRUE(tok.isKnownId(128814));
  const std::vector<TokenId> ids = {19923, 128815, 200000, 14};
  EXPECT_EQ(tok.decode(ids), "Hello,");
  EXPECT_FALSE(tok.tokenBytes(128815).has_value());
}

TEST(Tokenizer, SpecialFlagsAndBos) {
  PD_REQUIRE_TOKENIZER(tok);
  EXPECT_EQ(tok.bosId(), std::optional<TokenId>(0));
  EXPECT_EQ(tok.eosId(), std::optional<TokenId>(1));
  EXPECT_TRUE(tok.isSpecial(0));
  EXPECT_TRUE(tok.isSpecial(128805));   // <|EOT|>
  EXPECT_FALSE(tok.isSpecial(128803));  // <｜User｜> stays with skip_special_tokens
  EXPECT_EQ(tok.tokenToId("<｜Assistant｜>"), std::optional<TokenId>(128804));
  EXPECT_EQ(tok.encode("<｜end▁of▁sentence｜>", true).value(), (std::vector<TokenId>{0, 1}));
}

// decode(encode(text)) == text for any valid text: random code points from every plane, with
// added-token strings, digits and whitespace mixed in.
TEST(Tokenizer, RoundTripsRandomText) {
  PD_REQUIRE_TOKENIZER(tok);
  std::mt19937 rng(20250611);
  const std::vector<std::string> fragments = {
      "<｜User｜>",     " ",  "\n",   "\r\n",     "  ", "123456", "\u0085", "\uFEFF",
      "<｜tool▁sep｜>", "'s", "中文", "カタカナ", "\t", "!!",     "é"};
  for (int round = 0; round < 300; ++round) {
    std::string text;
    const int n = static_cast<int>(rng() % 40);
    for (int k = 0; k < n; ++k) {
      const auto choice = rng() % 4;
      if (choice == 0) {
        text += fragments[rng() % fragments.size()];
      } else {
        char32_t cp = 0;
        do {
          cp = choice == 1 ? rng() % 0x80 : (choice == 2 ? rng() % 0x3000 : rng() % 0x110000);
        } while (cp >= 0xD800 && cp <= 0xDFFF);
        std::string utf8;
        if (cp < 0x80) {
          utf8 = std::string(1, static_cast<char>(cp));
        } else if (cp < 0x800) {
          utf8 = {static_cast<char>(0xC0 | (cp >> 6)), static_cast<char>(0x80 | (cp & 0x3F))};
        } else if (cp < 0x10000) {
          utf8 = {static_cast<char>(0xE0 | (cp >> 12)), static_cast<char>(0x80 | ((cp >> 6) & 0x3F)),
                  static_cast<char>(0x80 | (cp & 0x3F))};
        } else {
          utf8 = {static_cast<char>(0xF0 | (cp >> 18)), static_cast<char>(0x80 | ((cp >> 12) & 0x3F)),
                  static_cast<char>(0x80 | ((cp >> 6) & 0x3F)), static_cast<char>(0x80 | (cp & 0x3F))};
        }
        text += utf8;
      }
    }
    auto ids = tok.encode(text);
    ASSERT_TRUE(ids.ok()) << ids.error().toString();
    ASSERT_EQ(tok.decode(ids.value()), text) << "round " << round;
    auto pieces = tok.preTokenize(text);
    ASSERT_TRUE(pieces.ok());
    std::string joined;
    for (const auto p : pieces.value()) joined += p;
    ASSERT_EQ(joined, text);
  }
}

TEST(Tokenizer, LongInputsUseTheSameMerges) {
  PD_REQUIRE_TOKENIZER(tok);
  // Long pieces take the heap merge path; the result must equal merging shorter runs where the
  // pre-tokenizer would split them anyway, and round-trip.
  const std::string spaces(5000, ' ');
  auto ids = tok.encode(spaces);
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(tok.decode(ids.value()), spaces);
  std::string word;
  for (int k = 0; k < 3000; ++k) word += static_cast<char>('a' + (k * 7) % 26);
  ids = tok.encode(word);
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(tok.decode(ids.value()), word);
}

// A Tokenizer is shared by the router's threads: concurrent encodes give the same ids.
TEST(Tokenizer, ConcurrentEncodesAgree) {
  PD_REQUIRE_TOKENIZER(tok);
  const auto cases = readJsonl("cases.jsonl");
  std::vector<std::string> texts;
  std::vector<std::vector<TokenId>> want;
  for (const auto& c : cases) {
    texts.push_back(str(c.at("text")));
    want.push_back(idsOf(c.at("ids")));
  }
  std::vector<int> mismatches(4, 0);
  std::vector<std::thread> threads;
  threads.reserve(4);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 5; ++round) {
        for (std::size_t i = 0; i < texts.size(); ++i) {
          const std::size_t k =
              (i * 7 + static_cast<std::size_t>(t) * 13 + static_cast<std::size_t>(round)) % texts.size();
          if (tok.encode(texts[k]).value() != want[k]) ++mismatches[static_cast<std::size_t>(t)];
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(mismatches, std::vector<int>(4, 0));
}

// GPT-2's byte alphabet as a tokenizer.json vocabulary: ids 0..255 are the bytes, no merges.
std::string bytesOnlyTokenizerJson() {
  boost::json::object vocab;
  int extra = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    const int cp = printable ? b : extra++;
    std::string utf8;
    if (cp < 0x80) {
      utf8 = std::string(1, static_cast<char>(cp));
    } else {
      utf8 = {static_cast<char>(0xC0 | (cp >> 6)), static_cast<char>(0x80 | (cp & 0x3F))};
    }
    vocab[utf8] = b;
  }
  boost::json::object root = {
      {"added_tokens", boost::json::array{}},
      {"normalizer", nullptr},
      {"pre_tokenizer",
       {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}}},
      {"post_processor", nullptr},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", boost::json::array{}}}}};
  return boost::json::serialize(root);
}

// The per-thread memo of merged pieces belongs to one tokenizer: alternating two tokenizers on a
// thread never mixes their results.
TEST(Tokenizer, TwoTokenizersOnOneThread) {
  PD_REQUIRE_TOKENIZER(tok);
  auto bytes_only = Tokenizer::fromJson(bytesOnlyTokenizerJson(), "");
  ASSERT_TRUE(bytes_only.ok()) << bytes_only.error().toString();
  const std::string text = "Xyzzyplughqwv";  // one piece, not a vocabulary token: goes through the memo
  const auto real = tok.encode(text).value();
  EXPECT_GT(real.size(), 1u);
  EXPECT_LT(real.size(), text.size());
  for (int round = 0; round < 3; ++round) {
    EXPECT_EQ(tok.encode(text).value(), real);
    const auto ids = bytes_only.value().encode(text).value();
    ASSERT_EQ(ids.size(), text.size());
    for (std::size_t k = 0; k < text.size(); ++k) EXPECT_EQ(ids[k], static_cast<TokenId>(text[k]));
    EXPECT_EQ(bytes_only.value().decode(ids), text);
  }
}

TEST(Tokenizer, UnsupportedTokenizerJsonFailsAtLoad) {
  const std::string base = R"({"added_tokens": [], "normalizer": null,
    "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
      {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]},
    "post_processor": null, "decoder": {"type": "ByteLevel"},
    "model": {"type": "BPE", "vocab": {}, "merges": []}})";
  auto missing_bytes = Tokenizer::fromJson(base, "");
  ASSERT_FALSE(missing_bytes.ok());
  EXPECT_EQ(missing_bytes.error().code, ErrorCode::Unsupported);

  std::string nfc = base;
  nfc.replace(nfc.find("\"normalizer\": null"), 18, R"("normalizer": {"type": "NFC"})");
  auto normalizer = Tokenizer::fromJson(nfc, "");
  ASSERT_FALSE(normalizer.ok());
  EXPECT_EQ(normalizer.error().code, ErrorCode::Unsupported);
  EXPECT_NE(normalizer.error().message.find("normalizer"), std::string::npos);

  std::string regex = base;
  regex.replace(regex.find("[\n"), 2,
                R"([{"type": "Split", "pattern": {"Regex": "\\w+"}, "behavior": "Isolated", "invert": false},)");
  auto split = Tokenizer::fromJson(regex, "");
  ASSERT_FALSE(split.ok());
  EXPECT_EQ(split.error().code, ErrorCode::Unsupported);
  EXPECT_NE(split.error().message.find("\\w+"), std::string::npos) << split.error().message;

  auto corrupt = Tokenizer::fromJson("{not json", "");
  ASSERT_FALSE(corrupt.ok());
  EXPECT_EQ(corrupt.error().code, ErrorCode::Corrupt);

  auto missing = Tokenizer::load("/nonexistent/tokenizer/dir");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.error().code, ErrorCode::NotFound);
}

}  // namespace
}  // namespace pd::tokenizer
