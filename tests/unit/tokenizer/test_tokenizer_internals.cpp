// White-box checks of the tokenizer's parts: the two BPE merge loops agree, and the hand-written
// pre-tokenizer matches a backtracking regex engine (PCRE2) running the tokenizer.json patterns.
#include <gtest/gtest.h>
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <random>
#include <set>

#include "bpe.h"
#include "tokenizer_test_support.h"
#include "unicode_class.h"

namespace pd::tokenizer {
namespace {

using detail::BpeModel;
using detail::BpeScratch;
using detail::Id;

// A random BPE model over bytes 'a'..'f' plus all other bytes: ids 0..255 are the bytes, each
// merge adds a token made of two existing ones.
BpeModel randomModel(std::mt19937& rng, std::vector<std::string>& tokens) {
  tokens.clear();
  for (int b = 0; b < 256; ++b) tokens.emplace_back(1, static_cast<char>(b));
  std::set<std::string> seen(tokens.begin(), tokens.end());
  std::vector<BpeModel::MergeRule> merges;
  std::set<std::pair<Id, Id>> pairs;
  while (merges.size() < 3000) {
    const Id left = rng() % 3 == 0 ? static_cast<Id>('a' + rng() % 6) : static_cast<Id>(rng() % tokens.size());
    const Id right = rng() % 3 == 0 ? static_cast<Id>('a' + rng() % 6) : static_cast<Id>(rng() % tokens.size());
    const std::string joined = tokens[left] + tokens[right];
    if (joined.size() > 10 || !pairs.insert({left, right}).second) continue;
    Id result = 0;
    if (seen.insert(joined).second) {
      result = static_cast<Id>(tokens.size());
      tokens.push_back(joined);
    } else {
      result = static_cast<Id>(std::find(tokens.begin(), tokens.end(), joined) - tokens.begin());
    }
    merges.push_back({left, right, result});
  }
  auto model = BpeModel::create(tokens, merges);
  EXPECT_TRUE(model.ok());
  return std::move(model).value();
}

TEST(BpeInternals, ScanAndHeapMergeLoopsAgree) {
  std::mt19937 rng(11);
  for (int round = 0; round < 4; ++round) {
    std::vector<std::string> tokens;
    const BpeModel model = randomModel(rng, tokens);
    BpeScratch scratch;
    for (int k = 0; k < 2000; ++k) {
      std::string piece;
      const std::size_t n = 1 + rng() % 120;
      for (std::size_t i = 0; i < n; ++i)
        piece.push_back(rng() % 8 == 0 ? static_cast<char>(rng() % 256) : static_cast<char>('a' + rng() % 6));
      std::vector<Id> scan;
      std::vector<Id> heap;
      std::vector<Id> chosen;
      model.mergeByScan(piece, scratch, scan);
      model.mergeByHeap(piece, scratch, heap);
      model.encode(piece, scratch, chosen);
      ASSERT_EQ(scan, heap) << "piece " << piece;
      ASSERT_EQ(chosen, scan) << "piece " << piece;
      std::string joined;
      for (const Id id : scan) joined += tokens[id];
      ASSERT_EQ(joined, piece);
    }
  }
}

// The pre-tokenizer sequence run by PCRE2 (UTF + UCP), for characters on which PCRE2's tables
// (Unicode 14, \s = \p{Z} + \h + \v) agree with Oniguruma's (Unicode 16, \s = White_Space).
class Pcre2PreTokenizer {
 public:
  Pcre2PreTokenizer() {
    const char* patterns[] = {
        R"(\p{N}{1,3})",
        "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
        ("[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+|"
         " ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"),
    };
    for (const char* p : patterns) {
      int error = 0;
      PCRE2_SIZE offset = 0;
      pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(p), PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP,
                                       &error, &offset, nullptr);
      EXPECT_NE(code, nullptr) << "pattern " << p;
      codes_.push_back(code);
    }
    match_ = pcre2_match_data_create(16, nullptr);
  }
  ~Pcre2PreTokenizer() {
    pcre2_match_data_free(match_);
    for (auto* c : codes_) pcre2_code_free(c);
  }
  Pcre2PreTokenizer(const Pcre2PreTokenizer&) = delete;
  Pcre2PreTokenizer& operator=(const Pcre2PreTokenizer&) = delete;
  Pcre2PreTokenizer(Pcre2PreTokenizer&&) = delete;
  Pcre2PreTokenizer& operator=(Pcre2PreTokenizer&&) = delete;

  std::vector<std::string> split(const std::string& text) {
    std::vector<std::string> pieces{text};
    for (auto* code : codes_) {
      std::vector<std::string> next;
      for (const auto& piece : pieces) {
        std::size_t last = 0;
        std::size_t pos = 0;
        while (pos < piece.size()) {
          const int rc =
              pcre2_match(code, reinterpret_cast<PCRE2_SPTR>(piece.data()), piece.size(), pos, 0, match_, nullptr);
          if (rc < 0) break;
          const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(match_);
          if (ov[0] > last) next.push_back(piece.substr(last, ov[0] - last));
          next.push_back(piece.substr(ov[0], ov[1] - ov[0]));
          last = pos = ov[1];
        }
        if (last < piece.size()) next.push_back(piece.substr(last));
      }
      pieces = std::move(next);
    }
    return pieces;
  }

 private:
  std::vector<pcre2_code*> codes_;
  pcre2_match_data* match_ = nullptr;
};

TEST(PreTokenizerInternals, MatchesPcre2OnRandomText) {
  PD_REQUIRE_TOKENIZER(tok);
  // Letters, marks, numbers (Nd, Nl, No), punctuation, symbols, white space of every kind the
  // patterns single out, CJK inside and outside the isolated ranges, controls and format chars.
  const std::vector<std::string> alphabet = {
      "a",      "Z",      "q",      "é",      "ß",      "Ж",      "ا",      "क",      "ि",      "\u0301",    "\u064B",
      "0",      "7",      "٣",      "१",      "Ⅻ",      "①",      "²",      "½",      "〇",     "!",         "'",
      ".",      ",",      "-",      "_",      "(",      "]",      "«",      "。",     "、",     "$",         "+",
      "€",      "©",      "😀",      "→",      " ",      " ",      " ",      "\t",     "\n",     "\r",        "\u000B",
      "\u0085", "\u00A0", "\u2028", "\u3000", "\u2003", "\uFEFF", "\u200B", "\u200D", "\u0007", "中",        "文",
      "龥",     "龦",     "㐀",     "あ",     "カ",     "ｶ",      "한",     "ー",     "ヿ",     "\U00020000"};
  Pcre2PreTokenizer reference;
  std::mt19937 rng(5);
  for (int round = 0; round < 3000; ++round) {
    std::string text;
    const int n = 1 + static_cast<int>(rng() % 16);
    for (int k = 0; k < n; ++k) text += alphabet[rng() % alphabet.size()];
    auto pieces = tok.preTokenize(text);
    ASSERT_TRUE(pieces.ok());
    const std::vector<std::string> got(pieces.value().begin(), pieces.value().end());
    ASSERT_EQ(got, reference.split(text)) << "text: " << text;
  }
}

TEST(UnicodeInternals, Version16ClassesAndOnigurumaWhiteSpace) {
  using detail::charClasses;
  EXPECT_EQ(charClasses(U'\u0085'), detail::kWhiteSpace);
  EXPECT_EQ(charClasses(U'\uFEFF'), 0);
  EXPECT_EQ(charClasses(0x180E), 0);                 // no longer White_Space
  EXPECT_EQ(charClasses(0x1FAE9), detail::kSymbol);  // added in 16.0
  EXPECT_EQ(charClasses(0x1CC00), detail::kSymbol);
  EXPECT_EQ(charClasses(0x16D40), detail::kLetter);
  EXPECT_EQ(charClasses(0x1FAEA), 0);  // added in 17.0: unassigned here
  EXPECT_EQ(charClasses(0x1FAC8), 0);
  EXPECT_EQ(charClasses(U'Ⅻ'), detail::kNumber);
  EXPECT_EQ(charClasses(0x10FFFF), 0);
  EXPECT_EQ(charClasses(0x110000), 0);
}

}  // namespace
}  // namespace pd::tokenizer
