// The model, checkpoint and tokenizer commands' logic (tools/model_tools): prompt ids, the
// checkpoint summary of a generated model, the JSONL filters' answers.
#include <gtest/gtest.h>

#include <boost/json.hpp>
#include <cstdio>
#include <filesystem>
#include <sstream>

#include "model_tools/checkpoint_summary.h"
#include "model_tools/model_run.h"
#include "model_tools/text_filters.h"
#include "pd/engine/model_factory.h"
#include "support/test_files.h"

namespace pd::tools {
namespace {

TEST(ModelRun, PromptIdsAreCommaSeparatedIdsInTheVocabulary) {
  auto ids = parsePromptIds(" 1, 2 ,3", 10);
  ASSERT_TRUE(ids.ok()) << ids.error().toString();
  EXPECT_EQ(*ids, (std::vector<std::int32_t>{1, 2, 3}));
  EXPECT_EQ(idsJson(*ids), "[1, 2, 3]");
  EXPECT_EQ(idsJson({}), "[]");
  for (const char* bad : {"10", "-1", "1,,2", "1x", "", "1,"}) {
    auto r = parsePromptIds(bad, 10);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.error().code, ErrorCode::InvalidArgument) << bad;
    EXPECT_NE(r.error().message.find("--prompt-ids"), std::string::npos) << bad;
  }
}

TEST(CheckpointSummary, LayerIndexOfTensorNames) {
  EXPECT_EQ(layerOf("model.layers.12.mlp.gate.weight"), 12);
  EXPECT_EQ(layerOf("model.layers.x.mlp"), -1);
  EXPECT_EQ(layerOf("model.embed_tokens.weight"), -1);
  EXPECT_EQ(humanQuantity(999, ""), "999");
  EXPECT_EQ(humanQuantity(1234567, "B"), "1.23 MB");
  EXPECT_EQ(humanQuantity(2.5e15, "B"), "2500.00 TB") << "T is the largest prefix";
}

TEST(CheckpointSummary, CountsEveryTensorOfAGeneratedModel) {
  auto cfg = presetConfig("tiny");
  ASSERT_TRUE(cfg.ok()) << cfg.error().toString();
  test::TempDir dir;
  auto made = makeModel(*cfg, dir.path(), {});
  ASSERT_TRUE(made.ok()) << made.error().toString();
  auto in = inspectCheckpoint(dir.path());
  ASSERT_TRUE(in.ok()) << in.error().toString();
  EXPECT_TRUE(in->valid.ok());
  EXPECT_EQ(static_cast<std::int64_t>(in->tensors), made->tensors);
  const CheckpointSummary& s = in->summary;
  EXPECT_EQ(s.params_total, s.params_main + s.params_mtp);
  std::uint64_t bytes = 0;
  for (const auto& [name, d] : s.by_dtype) bytes += d.bytes;
  EXPECT_EQ(bytes, made->tensor_bytes) << "every byte counted under its dtype";
  EXPECT_GT(s.activated_bytes_main, 0);
  EXPECT_LT(s.activated_bytes_main, static_cast<double>(made->tensor_bytes)) << "not every expert is read";
  EXPECT_EQ(s.kv_bytes_main, cfg->num_hidden_layers * cfg->latentDim() * 2);

  const auto json = boost::json::parse(inspectionJson(*in)).as_object();
  EXPECT_TRUE(json.at("valid").as_bool());
  EXPECT_EQ(json.at("parameters").as_object().at("total").as_int64(), s.params_total);
  EXPECT_NE(inspectionText(*in).find("all match config.json"), std::string::npos);

  auto missing = inspectCheckpoint(dir.path() / "none");
  EXPECT_FALSE(missing.ok());
}

// The fetched DeepSeek-V3 tokenizer (scripts/fetch-tokenizer.sh); skipped without it.
Result<TextFilter> filterOf(TextFilterKind kind) {
  TextFilterConfig cfg;
  cfg.kind = kind;
  cfg.tokenizer_dir = PD_TOKENIZER_DIR;
  return TextFilter::create(cfg);
}

TEST(TextFilters, RoundTripAndLineErrors) {
  if (!std::filesystem::exists(std::filesystem::path(PD_TOKENIZER_DIR) / "tokenizer.json")) {
    GTEST_SKIP() << "no tokenizer at " << PD_TOKENIZER_DIR << " (scripts/fetch-tokenizer.sh)";
  }
  auto tok = filterOf(TextFilterKind::Tokenize);
  ASSERT_TRUE(tok.ok()) << tok.error().toString();
  auto detok = filterOf(TextFilterKind::Detokenize);
  ASSERT_TRUE(detok.ok()) << detok.error().toString();
  auto ids = tok->answer(R"({"text": "Hello, world"})");
  ASSERT_TRUE(ids.ok()) << ids.error().toString();
  const auto ids_json = boost::json::parse(*ids).as_object().at("ids");
  auto text = detok->answer(boost::json::serialize(boost::json::object{{"ids", ids_json}}));
  ASSERT_TRUE(text.ok()) << text.error().toString();
  EXPECT_EQ(boost::json::parse(*text).as_object().at("text").as_string(), "Hello, world");

  EXPECT_NE(tok->answer("{").error().message.find("invalid JSON"), std::string::npos);
  EXPECT_NE(tok->answer("[1]").error().message.find("expected a JSON object"), std::string::npos);
  EXPECT_NE(tok->answer(R"({"txt": "a"})").error().message.find("expected {\"text\": string}"), std::string::npos);
  EXPECT_NE(detok->answer(R"({"ids": [-1]})").error().message.find("not in the vocabulary"), std::string::npos);

  // A run answers every non-blank line in order and exits 2 when one failed.
  std::istringstream in("{\"text\": \"a\"}\n\n   \nnot json\n{\"text\": \"b\"}\n");
  std::FILE* out = std::tmpfile();
  std::FILE* err = std::tmpfile();
  ASSERT_NE(out, nullptr);
  ASSERT_NE(err, nullptr);
  EXPECT_EQ(tok->run(in, out, err), 2);
  std::rewind(out);
  char buf[4096] = {};
  const std::size_t n = std::fread(buf, 1, sizeof(buf) - 1, out);
  const std::string written(buf, n);
  EXPECT_EQ(std::count(written.begin(), written.end(), '\n'), 3) << written;
  EXPECT_NE(written.find("{\"error\":"), std::string::npos) << written;
  std::rewind(err);
  const std::size_t m = std::fread(buf, 1, sizeof(buf) - 1, err);
  EXPECT_NE(std::string(buf, m).find("pdserve tokenize: line 4: invalid JSON"), std::string::npos);
  std::fclose(out);
  std::fclose(err);
}

}  // namespace
}  // namespace pd::tools
