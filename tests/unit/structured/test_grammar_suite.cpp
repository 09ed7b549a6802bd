// The schema suite (tests/data/structured/schema_suite.jsonl) over the real DeepSeek-V3
// vocabulary: for each schema, generations sampled uniformly at random among the allowed tokens
// (exactly a random-weight model under the mask). Every step's mask is non-empty, every sampled
// token is accepted, tokens outside the mask are refused, a mask after accept + rollback equals
// the mask before, and every output parses and validates against its schema with the independent
// python3-jsonschema checker (check_outputs.py).

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <boost/json.hpp>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "grammar_test_support.h"
#include "pd/structured/grammar.h"
#include "pd/structured/tool_call_parser.h"
#include "unit/tokenizer/tokenizer_test_support.h"

namespace pd::structured {
namespace {

using testing::allowed;
using testing::countAllowed;
using testing::nthAllowed;

constexpr std::size_t kModelVocab = 129280;  // DeepSeek-V3's embedding rows (the tokenizer has 128815)
constexpr int kGenerations = 500;
// No generation comes near this: the suite's strings have a maxLength or get at most
// kUnboundedStringChars characters (map keys, generic JSON); arrays, maps and numbers end with
// the probability of a closing token at each step (docs/structured-outputs.md).
constexpr std::size_t kMaxTokens = 3000;
constexpr std::uint32_t kUnboundedStringChars = 32;

struct SuiteEntry {
  std::string name;
  std::string schema;           // "" for json_object
  std::string check_schema;     // what the checker validates against
  bool duplicate_keys = false;  // objects with arbitrary keys may repeat one
};

std::vector<SuiteEntry> loadSuite() {
  std::vector<SuiteEntry> suite;
  std::ifstream in(std::filesystem::path(PD_TEST_DATA_DIR) / "structured" / "schema_suite.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    const auto row = boost::json::parse(line).as_object();
    SuiteEntry e;
    e.name = std::string(row.at("name").as_string());
    e.duplicate_keys = row.contains("duplicate_keys") && row.at("duplicate_keys").as_bool();
    if (row.contains("schema")) {
      e.schema = boost::json::serialize(row.at("schema"));
      e.check_schema = e.schema;
    } else {
      e.check_schema = R"({"type":"object"})";
    }
    suite.push_back(std::move(e));
  }
  return suite;
}

const std::shared_ptr<const TokenVocabulary>* sharedVocabulary(const tokenizer::Tokenizer& tok) {
  static auto vocab = TokenVocabulary::fromTokenizer(tok, kModelVocab);
  return vocab.ok() ? &vocab.value() : nullptr;
}

class GrammarSuite : public ::testing::TestWithParam<SuiteEntry> {};

TEST_P(GrammarSuite, RandomGenerationsValidate) {
  PD_REQUIRE_TOKENIZER(tok);
  const auto* vocab_ptr = sharedVocabulary(tok);
  ASSERT_NE(vocab_ptr, nullptr);
  const auto& vocab = *vocab_ptr;
  const SuiteEntry& entry = GetParam();
  GrammarOptions options;
  options.unbounded_string_chars = kUnboundedStringChars;
  auto grammar = entry.schema.empty() ? Grammar::anyJsonObject(vocab, options)
                                      : Grammar::fromJsonSchema(entry.schema, vocab, options);
  ASSERT_TRUE(grammar.ok()) << grammar.error().toString();

  // Per process: two test runs on one machine (two CI clones at once) must not share the file.
  const auto dir =
      std::filesystem::path(::testing::TempDir()) / ("grammar_suite_" + entry.name + "_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const auto out_path = dir / "outputs.jsonl";
  std::ofstream out(out_path);
  const auto check_schema = boost::json::parse(entry.check_schema);

  std::mt19937_64 rng(0x5eed0000U + std::hash<std::string>{}(entry.name));
  std::vector<MaskWord> mask(vocab->maskWords());
  std::vector<MaskWord> again(vocab->maskWords());
  std::size_t total_tokens = 0;
  std::size_t rollbacks = 0;
  std::size_t brute_checks = 0;
  for (int g = 0; g < kGenerations; ++g) {
    Matcher m(grammar.value());
    std::string text;
    bool stopped = false;
    for (std::size_t step = 0; step < kMaxTokens && !stopped; ++step) {
      m.fillMask(mask);
      const std::size_t n = countAllowed(mask);
      ASSERT_GT(n, 0U) << entry.name << ": empty mask after " << boost::json::serialize(boost::json::string(text));
      // Now and then the whole mask against brute force: exactly the tokens accept() takes.
      if (brute_checks < 2 && step % 3 == 2) {
        std::vector<MaskWord> brute(vocab->maskWords(), 0);
        for (std::size_t id = 0; id < kModelVocab; ++id) {
          if (m.accept(static_cast<TokenId>(id)).ok()) {
            brute[id / 64] |= MaskWord{1} << (id % 64);
            m.rollback(1);
          }
        }
        ASSERT_EQ(brute, mask) << entry.name << ": the mask differs from the tokens accept() takes after " << text;
        ++brute_checks;
      }
      // A token outside the mask is refused (and leaves the state alone).
      const auto probe = static_cast<TokenId>(rng() % kModelVocab);
      if (!allowed(mask, probe)) {
        ASSERT_FALSE(m.accept(probe).ok())
            << entry.name << ": token " << probe << " outside the mask accepted after " << text;
      }
      // Now and then take up to three tokens ahead, roll them back, and compare masks (MTP drafts).
      if (rng() % 8 == 0) {
        std::size_t ahead = 0;
        for (; ahead < 3 && !m.isTerminated(); ++ahead) {
          m.fillMask(again);
          const TokenId t = nthAllowed(again, rng() % countAllowed(again));
          ASSERT_TRUE(m.accept(t).ok());
        }
        m.rollback(ahead);
        m.fillMask(again);
        ASSERT_EQ(mask, again) << entry.name << ": mask after accept+rollback differs, after " << text;
        ++rollbacks;
      }
      const TokenId t = nthAllowed(mask, rng() % n);
      if (vocab->isStopToken(t)) {
        ASSERT_TRUE(m.isComplete());
        ASSERT_TRUE(m.accept(t).ok());
        stopped = true;
        break;
      }
      ASSERT_TRUE(m.accept(t).ok()) << entry.name << ": token " << t << " in the mask refused after " << text;
      text += *vocab->tokenBytes(t);
      ++total_tokens;
    }
    ASSERT_TRUE(stopped) << entry.name << ": no stop token within " << kMaxTokens << " tokens: " << text.substr(0, 300);
    boost::json::object row;
    row["schema"] = check_schema;
    row["output"] = text;
    row["duplicate_keys"] = entry.duplicate_keys;
    out << boost::json::serialize(row) << "\n";
    boost::system::error_code ec;
    (void)boost::json::parse(text, ec);
    ASSERT_FALSE(ec) << entry.name << ": not JSON: " << text;
  }
  out.close();
  RecordProperty("tokens", static_cast<int>(total_tokens));
  std::cout << entry.name << ": " << kGenerations << " generations, " << total_tokens << " tokens, " << rollbacks
            << " rollback checks, " << brute_checks << " brute-force mask checks\n";
  const std::string cmd = "python3 '" + std::string(PD_STRUCTURED_CHECKER) + "' '" + out_path.string() + "'";
  const int rc = std::system(cmd.c_str());
  EXPECT_EQ(rc, 0) << cmd;
  std::filesystem::remove_all(dir);
}

// Tool-call grammars (tool_choice "required") in both DeepSeek formats, sampled at random over the
// real vocabulary: the output, parsed back by ToolCallParser, is one call (or 1..8 with parallel)
// of a listed tool whose arguments validate against its parameters.
struct ToolCase {
  ToolCallFormat format;
  bool parallel;
};

class ToolCallSuite : public ::testing::TestWithParam<ToolCase> {};

TEST_P(ToolCallSuite, RandomCallsParseAndValidate) {
  PD_REQUIRE_TOKENIZER(tok);
  const auto* vocab_ptr = sharedVocabulary(tok);
  ASSERT_NE(vocab_ptr, nullptr);
  const auto& vocab = *vocab_ptr;
  const std::vector<ToolSpec> tools = {
      {"get_weather", R"({"type":"object","properties":{"city":{"type":"string","maxLength":20},)"
                      R"("unit":{"enum":["celsius","fahrenheit"]}},"required":["city"],"additionalProperties":false})"},
      {"add", R"({"type":"object","properties":{"a":{"type":"integer"},"b":{"type":"number"}},"required":["a","b"],)"
              R"("additionalProperties":false})"},
      {"anything", ""}};
  GrammarOptions options;
  options.unbounded_string_chars = kUnboundedStringChars;
  const ToolCase c = GetParam();
  auto grammar = Grammar::forToolCalls(tools, c.format, c.parallel, vocab, options);
  ASSERT_TRUE(grammar.ok()) << grammar.error().toString();

  const auto dir = std::filesystem::path(::testing::TempDir()) /
                   ("tool_suite_" + std::string(toolCallFormatName(c.format)) + (c.parallel ? "_parallel" : "") + "_" +
                    std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const auto out_path = dir / "arguments.jsonl";
  std::ofstream out(out_path);
  std::mt19937_64 rng(0x700150000U + static_cast<unsigned>(c.format) * 2 + (c.parallel ? 1 : 0));
  std::vector<MaskWord> mask(vocab->maskWords());
  std::size_t calls_seen = 0;
  std::size_t max_calls = 0;
  constexpr int kToolGenerations = 200;
  for (int g = 0; g < kToolGenerations; ++g) {
    Matcher m(grammar.value());
    std::string text;
    bool stopped = false;
    for (std::size_t step = 0; step < kMaxTokens; ++step) {
      m.fillMask(mask);
      const std::size_t n = countAllowed(mask);
      ASSERT_GT(n, 0U) << "empty mask after " << text;
      const TokenId t = nthAllowed(mask, rng() % n);
      ASSERT_TRUE(m.accept(t).ok());
      if (vocab->isStopToken(t)) {
        stopped = true;
        break;
      }
      const auto bytes = vocab->tokenBytes(t);
      text += bytes ? std::string(*bytes) : std::string(*tok.tokenString(t));  // a marker: its content
    }
    ASSERT_TRUE(stopped) << text.substr(0, 300);
    const auto parsed = ToolCallParser::parseAll(c.format, "call_", text);
    EXPECT_EQ(parsed.content, "") << text;
    ASSERT_FALSE(parsed.tool_calls.empty()) << text;
    if (!c.parallel) {
      ASSERT_EQ(parsed.tool_calls.size(), 1U) << text;
    }
    calls_seen += parsed.tool_calls.size();
    max_calls = std::max(max_calls, parsed.tool_calls.size());
    for (const auto& call : parsed.tool_calls) {
      const auto tool =
          std::find_if(tools.begin(), tools.end(), [&](const ToolSpec& s) { return s.name == call.name; });
      ASSERT_NE(tool, tools.end()) << call.name;
      boost::json::object row;
      row["schema"] =
          boost::json::parse(tool->parameters_json.empty() ? R"({"type":"object"})" : tool->parameters_json);
      row["output"] = call.arguments;
      row["duplicate_keys"] = tool->parameters_json.empty();
      out << boost::json::serialize(row) << "\n";
    }
  }
  out.close();
  std::cout << toolCallFormatName(c.format) << (c.parallel ? " parallel" : "") << ": " << kToolGenerations
            << " sections, " << calls_seen << " calls, at most " << max_calls << " in one\n";
  if (c.parallel) {
    EXPECT_GT(max_calls, 1U);
  }
  const std::string cmd = "python3 '" + std::string(PD_STRUCTURED_CHECKER) + "' '" + out_path.string() + "'";
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::filesystem::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(
    Formats, ToolCallSuite,
    ::testing::Values(ToolCase{ToolCallFormat::DeepSeekV3, false}, ToolCase{ToolCallFormat::DeepSeekV3, true},
                      ToolCase{ToolCallFormat::DeepSeekV31, false}, ToolCase{ToolCallFormat::DeepSeekV31, true}),
    [](const ::testing::TestParamInfo<ToolCase>& param) {
      return std::string(toolCallFormatName(param.param.format)) + (param.param.parallel ? "_parallel" : "_single");
    });

INSTANTIATE_TEST_SUITE_P(Suite, GrammarSuite, ::testing::ValuesIn(loadSuite()),
                         [](const ::testing::TestParamInfo<SuiteEntry>& param) { return param.param.name; });

}  // namespace
}  // namespace pd::structured
