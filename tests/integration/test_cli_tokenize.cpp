// Runs the real pdserve binary: tokenize / detokenize / chat-template over every golden case,
// their JSONL contracts, per-line errors and exit codes.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <boost/json.hpp>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "support/cli_runner.h"
#include "unit/tokenizer/tokenizer_test_support.h"

namespace {

namespace fs = std::filesystem;
using pd::tokenizer::testing::readJsonl;

using pd::test::CommandResult;
using pd::test::pdserve;

std::string line(const boost::json::object& obj) {
  return boost::json::serialize(obj) + "\n";
}

class CliTokenize : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string problem = pd::tokenizer::testing::checkTokenizerFiles();
    ASSERT_TRUE(problem.empty()) << problem;
  }
  const std::string dir_ = pd::tokenizer::testing::tokenizerDir().string();
};

TEST_F(CliTokenize, TokenizeEveryGoldenCase) {
  const auto cases = readJsonl("cases.jsonl");
  std::string input;
  for (const auto& c : cases) input += line({{"text", c.at("text")}});
  auto r = pdserve({"tokenize", "--tokenizer", dir_}, input);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  ASSERT_EQ(r.lines.size(), cases.size());
  for (std::size_t i = 0; i < cases.size(); ++i) {
    EXPECT_EQ(boost::json::parse(r.lines[i]), (boost::json::object{{"ids", cases[i].at("ids")}})) << "case " << i + 1;
  }
  r = pdserve({"tokenize", "--tokenizer", dir_, "--add-bos"}, input);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  ASSERT_EQ(r.lines.size(), cases.size());
  for (std::size_t i = 0; i < cases.size(); ++i) {
    EXPECT_EQ(boost::json::parse(r.lines[i]), (boost::json::object{{"ids", cases[i].at("ids_with_bos")}}))
        << "case " << i + 1;
  }
}

TEST_F(CliTokenize, DetokenizeEveryGoldenCase) {
  std::vector<boost::json::object> rows = readJsonl("decode_cases.jsonl");
  for (const auto& c : readJsonl("cases.jsonl")) rows.push_back(c);
  std::string input;
  for (const auto& c : rows) input += line({{"ids", c.at("ids")}});
  for (const bool skip : {false, true}) {
    std::vector<std::string> args = {"detokenize", "--tokenizer", dir_};
    if (skip) args.push_back("--skip-special");
    const auto r = pdserve(args, input);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    ASSERT_EQ(r.lines.size(), rows.size());
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const auto& want = rows[i].at(skip ? "decoded_skip_special" : "decoded");
      EXPECT_EQ(boost::json::parse(r.lines[i]), (boost::json::object{{"text", want}})) << "row " << i + 1;
    }
  }
}

TEST_F(CliTokenize, ChatTemplateEveryGoldenCase) {
  const auto cases = readJsonl("chat_cases.jsonl");
  std::string input;
  for (const auto& c : cases) {
    input += line({{"messages", c.at("messages")},
                   {"add_generation_prompt", c.at("add_generation_prompt")},
                   {"tools", c.at("tools")}});
  }
  const auto r = pdserve({"chat-template", "--tokenizer", dir_}, input);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  ASSERT_EQ(r.lines.size(), cases.size());
  for (std::size_t i = 0; i < cases.size(); ++i) {
    EXPECT_EQ(boost::json::parse(r.lines[i]),
              (boost::json::object{{"rendered", cases[i].at("rendered")}, {"ids", cases[i].at("ids")}}))
        << "case " << i + 1;
  }
}

TEST_F(CliTokenize, BadLinesGetAnErrorLineAndExitCode2) {
  auto r = pdserve({"tokenize", "--tokenizer", dir_},
                   "{\"text\": \"ok\"}\n\nnot json\n{\"text\": 5}\n{\"text\": \"\\ud800\"}\n{\"text\": \"\"}\n");
  EXPECT_EQ(r.exit_code, 2);
  ASSERT_EQ(r.lines.size(), 5u) << "the blank line gives no output line";
  EXPECT_EQ(r.lines[0], "{\"ids\":[633]}");
  EXPECT_NE(r.lines[1].find("\"error\":\"invalid JSON"), std::string::npos) << r.lines[1];
  EXPECT_NE(r.lines[2].find("\"error\""), std::string::npos) << r.lines[2];
  EXPECT_NE(r.lines[3].find("\"error\":\"invalid JSON"), std::string::npos) << r.lines[3];  // lone surrogate
  EXPECT_EQ(r.lines[4], "{\"ids\":[]}");
  EXPECT_NE(r.err.find("line 3"), std::string::npos) << r.err;

  r = pdserve({"detokenize", "--tokenizer", dir_}, "{\"ids\": [128815]}\n{\"ids\": [-3]}\n{\"ids\": []}\n");
  EXPECT_EQ(r.exit_code, 2);
  ASSERT_EQ(r.lines.size(), 3u);
  EXPECT_EQ(r.lines[0], "{\"error\":\"id 128815 is not in the vocabulary (0..128814)\"}");
  EXPECT_NE(r.lines[1].find("\"error\""), std::string::npos);
  EXPECT_EQ(r.lines[2], "{\"text\":\"\"}");

  r = pdserve({"chat-template", "--tokenizer", dir_},
              "{\"messages\": [{\"role\": \"user\", \"content\": null}]}\n{\"messages\": []}\n{\"messages\": 3}\n");
  EXPECT_EQ(r.exit_code, 2);
  ASSERT_EQ(r.lines.size(), 3u);
  EXPECT_NE(r.lines[0].find("unsupported operand types for +"), std::string::npos) << r.lines[0];
  EXPECT_EQ(r.lines[1], "{\"rendered\":\"<｜begin▁of▁sentence｜>\",\"ids\":[0]}");
  EXPECT_NE(r.lines[2].find("\"error\""), std::string::npos);
}

TEST_F(CliTokenize, MissingTokenizerSaysHowToFetchIt) {
  const auto r = pdserve({"tokenize", "--tokenizer", "/nonexistent/pd-tokenizer"}, "");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("run scripts/fetch-tokenizer.sh"), std::string::npos) << r.err;
}

}  // namespace
