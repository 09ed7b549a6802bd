#pragma once
// Shared by the tokenizer tests: the real DeepSeek-V3 tokenizer files (checked by sha256, loaded
// once per test binary) and the golden JSONL files.

#include <gtest/gtest.h>

#include <boost/json.hpp>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "pd/common/sha256.h"
#include "pd/tokenizer/tokenizer.h"

namespace pd::tokenizer::testing {

inline std::filesystem::path tokenizerDir() {
  return PD_TOKENIZER_DIR;
}
inline std::filesystem::path goldenDir() {
  return std::filesystem::path(PD_TEST_DATA_DIR) / "golden" / "tokenizer";
}

struct ExpectedFile {
  const char* name;
  const char* sha256;
};
inline constexpr ExpectedFile kTokenizerFiles[] = {
    {"tokenizer.json", "621ac2e32d0dba658404412318818aaa8ce8cda492e59830109d8da6b517fb41"},
    {"tokenizer_config.json", "637bcd1a08cf7c772ce6a383196b22930921c79c3c73223c5afc0c7f41545546"},
};

/// "" when both files are present with the expected sha256, else what is wrong.
inline std::string checkTokenizerFiles() {
  for (const auto& f : kTokenizerFiles) {
    const auto path = tokenizerDir() / f.name;
    auto digest = sha256File(path);
    if (!digest.ok()) {
      return path.string() + ": " + digest.error().toString() + " (run scripts/fetch-tokenizer.sh)";
    }
    if (digest.value() != f.sha256) {
      return path.string() + ": sha256 " + digest.value() + ", want " + f.sha256 + " (run scripts/fetch-tokenizer.sh)";
    }
  }
  return {};
}

/// The verified tokenizer, loaded once; nullptr with `error` set when unavailable.
inline const Tokenizer* sharedTokenizer(std::string* error) {
  static std::string load_error;
  static const Tokenizer* tokenizer = []() -> const Tokenizer* {
    load_error = checkTokenizerFiles();
    if (!load_error.empty()) return nullptr;
    auto loaded = Tokenizer::load(tokenizerDir());
    if (!loaded.ok()) {
      load_error = loaded.error().toString();
      return nullptr;
    }
    return new Tokenizer(std::move(loaded).value());  // lives for the whole test binary
  }();
  if (error != nullptr) *error = load_error;
  return tokenizer;
}

/// Fails the current test (never skips) when the tokenizer files are missing or wrong. `var`
/// names the variable it declares, so it cannot be parenthesized.
// NOLINTBEGIN(bugprone-macro-parentheses)
#define PD_REQUIRE_TOKENIZER(var)                                                                        \
  std::string var##_error;                                                                               \
  const ::pd::tokenizer::Tokenizer* var##_ptr = ::pd::tokenizer::testing::sharedTokenizer(&var##_error); \
  ASSERT_NE(var##_ptr, nullptr) << var##_error;                                                          \
  const ::pd::tokenizer::Tokenizer& var = *var##_ptr
// NOLINTEND(bugprone-macro-parentheses)

inline std::vector<boost::json::object> readJsonl(const std::string& name) {
  std::vector<boost::json::object> rows;
  std::ifstream in(goldenDir() / name);
  EXPECT_TRUE(in.good()) << "cannot open " << (goldenDir() / name);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    rows.push_back(boost::json::parse(line).as_object());
  }
  return rows;
}

inline std::vector<TokenId> idsOf(const boost::json::value& v) {
  std::vector<TokenId> ids;
  for (const auto& x : v.as_array()) ids.push_back(static_cast<TokenId>(x.as_int64()));
  return ids;
}

inline std::string str(const boost::json::value& v) {
  return std::string(v.as_string());
}

}  // namespace pd::tokenizer::testing
