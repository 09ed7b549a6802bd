// Logprobs through the whole system (`pdserve up`: router + prefill + decode processes, MTP on)
// equal the model's own log-softmax at temperature 1 over the full vocabulary, as `pdserve logits`
// computes it in one process, within 1e-4: the first token (sampled by the prefill worker), every
// decode token (MTP-accepted drafts included: the test checks some were accepted), greedy and
// sampled at another temperature and top_p (logprobs stay the raw model's), chat and completions
// shapes, streaming equal to non-streaming. The decode pool holds its latent KV in F32 here
// (decode.kv_dtype f32), as `pdserve logits` does: with the default BF16 pool the decode tokens'
// values carry the pool's rounding (up to 0.035 on these prompts), which is not what this checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <boost/json.hpp>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "pd/common/check.h"
#include "pd/common/worker_api.h"
#include "pd/engine/safetensors.h"
#include "pd/tokenizer/tokenizer.h"
#include "support/cli_runner.h"
#include "support/local_cluster.h"
#include "support/test_files.h"

namespace pd::test {
namespace {

namespace json = boost::json;
namespace fs = std::filesystem;

constexpr double kTolerance = 1e-4;

/// The largest |served - reference| seen, printed at the end of each test (what the 1e-4 bounds).
double g_max_diff = 0.0;
double diff(double got, double want) {
  g_max_diff = std::max(g_max_diff, std::abs(got - want));
  return got;
}
constexpr int kTop = 5;

const fs::path kModel = fs::path(PD_TEST_DATA_DIR) / ".." / ".." / "models" / "tiny-dsv3";

std::vector<std::int64_t> idsOf(const json::value& v) {
  std::vector<std::int64_t> out;
  for (const auto& t : v.as_array()) out.push_back(t.to_number<std::int64_t>());
  return out;
}

/// Log-softmax rows of `pdserve logits` over `ids` (row i: the distribution of token i + 1).
std::vector<std::vector<double>> referenceLogSoftmax(const std::vector<std::int64_t>& ids) {
  TempDir dir;
  std::string list;
  for (std::size_t i = 0; i < ids.size(); ++i) list += (i ? "," : "") + std::to_string(ids[i]);
  const fs::path out = dir.path() / "logits.safetensors";
  const CommandResult r =
      pdserveCommandLine("logits --model " + kModel.string() + " --prompt-ids " + list + " --out " + out.string());
  EXPECT_EQ(r.exit_code, 0) << r.err;
  auto file = SafetensorsFile::open(out);
  EXPECT_TRUE(file.ok());
  if (!file.ok()) return {};
  const TensorView* t = file->find("logits_all");
  EXPECT_NE(t, nullptr);
  if (t == nullptr || t->dtype != DType::F32 || t->shape.size() != 2) return {};
  const auto rows = static_cast<std::size_t>(t->shape[0]);
  const auto vocab = static_cast<std::size_t>(t->shape[1]);
  std::vector<float> logits(rows * vocab);
  std::memcpy(logits.data(), t->data.data(), logits.size() * sizeof(float));
  std::vector<std::vector<double>> out_rows(rows, std::vector<double>(vocab));
  for (std::size_t r0 = 0; r0 < rows; ++r0) {
    const float* row = logits.data() + r0 * vocab;
    const double mx = *std::max_element(row, row + vocab);
    double sum = 0.0;
    for (std::size_t v = 0; v < vocab; ++v) sum += std::exp(static_cast<double>(row[v]) - mx);
    const double lse = mx + std::log(sum);
    for (std::size_t v = 0; v < vocab; ++v) out_rows[r0][v] = static_cast<double>(row[v]) - lse;
  }
  return out_rows;
}

/// The `n` most likely ids of a row, best first (lowest id on ties, as the sampler orders them).
std::vector<std::int64_t> topIds(const std::vector<double>& row, int n) {
  std::vector<std::int64_t> order(row.size());
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + n, order.end(), [&](std::int64_t a, std::int64_t b) {
    return row[static_cast<std::size_t>(a)] > row[static_cast<std::size_t>(b)] ||
           (row[static_cast<std::size_t>(a)] == row[static_cast<std::size_t>(b)] && a < b);
  });
  order.resize(static_cast<std::size_t>(n));
  return order;
}

const tokenizer::Tokenizer& modelTokenizer() {
  static const auto t = [] {
    auto loaded = tokenizer::Tokenizer::load(kModel);
    PD_CHECK_MSG(loaded.ok(), "models/tiny-dsv3 has no tokenizer");
    return std::make_unique<tokenizer::Tokenizer>(std::move(loaded).value());
  }();
  return *t;
}

std::string tokenText(std::int64_t id) {
  const TokenId ids[] = {static_cast<TokenId>(id)};
  return modelTokenizer().decode(ids);
}

/// A token's text as JSON carries it: byte-level pieces of a character are not valid UTF-8 on
/// their own and reach the client replaced, so only ASCII texts are compared as strings.
bool ascii(const std::string& s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return static_cast<unsigned char>(c) < 0x80; });
}

/// The data of every `data:` event of a server-sent-event body but [DONE].
std::vector<json::object> sseEvents(const std::string& body) {
  std::vector<json::object> out;
  std::size_t pos = 0;
  while ((pos = body.find("data: ", pos)) != std::string::npos) {
    const std::size_t end = body.find("\n\n", pos);
    const std::string data = body.substr(pos + 6, end - pos - 6);
    pos = end;
    if (data != "[DONE]") out.push_back(json::parse(data).as_object());
  }
  return out;
}

class E2eLogprobs : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    cache_ = std::make_unique<TempDir>();
    cluster_ = std::make_unique<LocalCluster>(std::vector<std::string>{
        "--model.path=" + kModel.string(), "--model.cache_dir=" + cache_->path().string(), "--router.port=0",
        "--decode.num_speculative_tokens=1", "--decode.kv_dtype=f32", "--log.level=warn"});
    // up prints READY once the router listens; it routes once its polls put the workers in rotation.
    for (int i = 0; i < 600 && getPath(cluster_->host(), cluster_->port(), "/ready").status != 200; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  static void TearDownTestSuite() {
    cluster_.reset();
    cache_.reset();
  }
  void SetUp() override { ASSERT_FALSE(cluster_->url().empty()); }
  void TearDown() override { std::printf("max |logprob - reference| so far: %.3g\n", g_max_diff); }

  /// The decode worker's MTP drafts accepted so far.
  static std::int64_t draftsAccepted() {
    const std::string prefix = "PDSERVE_CHILD name=decode-";
    for (const auto& line : cluster_->stdoutLines()) {
      if (!line.starts_with(prefix)) continue;
      const auto at = line.find("url=http://");
      const std::string host_port = line.substr(at + 11);
      const auto colon = host_port.rfind(':');
      auto r = getPath(host_port.substr(0, colon), static_cast<std::uint16_t>(std::stoi(host_port.substr(colon + 1))),
                       std::string(worker_api::kStatusPath), cluster_->auth().get());
      auto st = worker_api::parseWorkerStatus(r.body);
      return st.ok() ? st->drafts_accepted : -1;
    }
    return -1;
  }

  static std::unique_ptr<TempDir> cache_;
  static std::unique_ptr<LocalCluster> cluster_;
};
std::unique_ptr<TempDir> E2eLogprobs::cache_;
std::unique_ptr<LocalCluster> E2eLogprobs::cluster_;

json::object chatBody(double temperature, bool stream) {
  json::object body{
      {"model", "pdserve-default"},
      {"messages", json::array{json::object{{"role", "user"}, {"content", "Tell me about the sea and the sky."}}}},
      {"max_tokens", 24},
      {"temperature", temperature},
      {"top_p", temperature == 0 ? 1.0 : 0.8},
      {"seed", 7},
      {"logprobs", true},
      {"top_logprobs", kTop},
      {"return_token_ids", true},
      {"stream", stream}};
  return body;
}

TEST_F(E2eLogprobs, ChatLogprobsAreTheModelsLogSoftmaxForEveryToken) {
  const std::int64_t accepted_before = draftsAccepted();
  for (const double temperature : {0.0, 0.7}) {
    SCOPED_TRACE("temperature " + std::to_string(temperature));
    const auto response = postJson(*cluster_, "/v1/chat/completions", json::serialize(chatBody(temperature, false)));
    ASSERT_EQ(response.status, 200) << response.body;
    const auto doc = json::parse(response.body).as_object();
    const auto prompt = idsOf(doc.at("prompt_token_ids"));
    const auto& choice = doc.at("choices").as_array().at(0).as_object();
    const auto generated = idsOf(choice.at("token_ids"));
    const auto& content = choice.at("logprobs").at("content").as_array();
    ASSERT_EQ(content.size(), generated.size());
    ASSERT_GE(generated.size(), 2U);

    std::vector<std::int64_t> all = prompt;
    all.insert(all.end(), generated.begin(), generated.end() - 1);
    const auto ref = referenceLogSoftmax(all);
    ASSERT_EQ(ref.size(), all.size());
    for (std::size_t i = 0; i < generated.size(); ++i) {
      SCOPED_TRACE("token " + std::to_string(i));
      const auto& row = ref[prompt.size() - 1 + i];
      const auto& entry = content[i].as_object();
      EXPECT_NEAR(diff(entry.at("logprob").to_number<double>(), row[static_cast<std::size_t>(generated[i])]),
                  row[static_cast<std::size_t>(generated[i])], kTolerance);
      if (ascii(tokenText(generated[i]))) {
        EXPECT_EQ(std::string(entry.at("token").as_string()), tokenText(generated[i]));
      }
      std::string bytes;
      for (const auto& b : entry.at("bytes").as_array()) bytes += static_cast<char>(b.to_number<int>());
      EXPECT_EQ(bytes, tokenText(generated[i]));
      const auto& top = entry.at("top_logprobs").as_array();
      ASSERT_EQ(top.size(), static_cast<std::size_t>(kTop));
      const auto want = topIds(row, kTop);
      for (int k = 0; k < kTop; ++k) {
        const double got = top[static_cast<std::size_t>(k)].at("logprob").to_number<double>();
        EXPECT_NEAR(diff(got, row[static_cast<std::size_t>(want[static_cast<std::size_t>(k)])]),
                    row[static_cast<std::size_t>(want[static_cast<std::size_t>(k)])], kTolerance)
            << "top " << k;
        // Which id is k-th is only defined where the values are apart.
        const bool distinct =
            (k == 0 || row[static_cast<std::size_t>(want[k - 1])] - row[static_cast<std::size_t>(want[k])] > 1e-3) &&
            (k + 1 == kTop ||
             row[static_cast<std::size_t>(want[k])] - row[static_cast<std::size_t>(want[k + 1])] > 1e-3);
        if (distinct && ascii(tokenText(want[static_cast<std::size_t>(k)]))) {
          EXPECT_EQ(std::string(top[static_cast<std::size_t>(k)].at("token").as_string()), tokenText(want[k]))
              << "top " << k;
        }
      }
      if (temperature == 0.0) {  // greedy picks the most likely token
        EXPECT_NEAR(entry.at("logprob").to_number<double>(), row[static_cast<std::size_t>(want[0])], kTolerance);
      }
    }

    // Streaming carries the same logprobs, token by token.
    const auto streamed = postJson(*cluster_, "/v1/chat/completions", json::serialize(chatBody(temperature, true)));
    ASSERT_EQ(streamed.status, 200) << streamed.body;
    json::array streamed_content;
    std::vector<std::int64_t> streamed_ids;
    for (const auto& event : sseEvents(streamed.body)) {
      const auto& c = event.at("choices").as_array();
      if (c.empty()) continue;
      const auto& lp = c.at(0).at("logprobs");
      if (lp.is_object()) {
        for (const auto& e : lp.at("content").as_array()) streamed_content.push_back(e);
      }
      if (const auto* t = c.at(0).as_object().if_contains("token_ids")) {
        for (const auto id : idsOf(*t)) streamed_ids.push_back(id);
      }
    }
    EXPECT_EQ(streamed_ids, generated);
    EXPECT_EQ(streamed_content, content);
  }
  // The generation ran with MTP and some drafts were accepted: their tokens were checked above.
  EXPECT_GT(draftsAccepted(), accepted_before);
}

TEST_F(E2eLogprobs, CompletionsLogprobsHaveTheLegacyShapeAndTheModelsValues) {
  const json::object body{{"model", "pdserve-default"},
                          {"prompt", "The sea is"},
                          {"max_tokens", 12},
                          {"temperature", 1.3},
                          {"seed", 11},
                          {"logprobs", 3},
                          {"return_token_ids", true}};
  const auto response = postJson(*cluster_, "/v1/completions", json::serialize(body));
  ASSERT_EQ(response.status, 200) << response.body;
  const auto doc = json::parse(response.body).as_object();
  const auto& choice = doc.at("choices").as_array().at(0).as_object();
  const auto prompt = idsOf(choice.at("prompt_token_ids"));
  const auto generated = idsOf(choice.at("token_ids"));
  const auto& lp = choice.at("logprobs").as_object();
  const auto& tokens = lp.at("tokens").as_array();
  const auto& values = lp.at("token_logprobs").as_array();
  const auto& tops = lp.at("top_logprobs").as_array();
  const auto& offsets = lp.at("text_offset").as_array();
  ASSERT_EQ(tokens.size(), generated.size());
  ASSERT_EQ(values.size(), generated.size());
  ASSERT_EQ(tops.size(), generated.size());
  ASSERT_EQ(offsets.size(), generated.size());

  std::vector<std::int64_t> all = prompt;
  all.insert(all.end(), generated.begin(), generated.end() - 1);
  const auto ref = referenceLogSoftmax(all);
  ASSERT_EQ(ref.size(), all.size());
  std::int64_t offset = 0;
  for (std::size_t i = 0; i < generated.size(); ++i) {
    SCOPED_TRACE("token " + std::to_string(i));
    const auto& row = ref[prompt.size() - 1 + i];
    if (ascii(tokenText(generated[i]))) {
      EXPECT_EQ(std::string(tokens[i].as_string()), tokenText(generated[i]));
    }
    EXPECT_NEAR(diff(values[i].to_number<double>(), row[static_cast<std::size_t>(generated[i])]),
                row[static_cast<std::size_t>(generated[i])], kTolerance);
    EXPECT_EQ(offsets[i].to_number<std::int64_t>(), offset);
    offset += static_cast<std::int64_t>(tokens[i].as_string().size());
    const auto& top = tops[i].as_object();
    EXPECT_LE(top.size(), 3U);  // three alternatives (fewer when two have the same text)
    for (const auto& [text, value] : top) {
      // Each alternative is one of the three most likely tokens, with its value.
      bool found = false;
      for (const auto id : topIds(row, 3)) {
        found = found || ((!ascii(tokenText(id)) || tokenText(id) == std::string_view(text)) &&
                          std::abs(value.to_number<double>() - row[static_cast<std::size_t>(id)]) <= kTolerance);
      }
      EXPECT_TRUE(found) << std::string_view(text);
    }
  }
}

}  // namespace
}  // namespace pd::test
