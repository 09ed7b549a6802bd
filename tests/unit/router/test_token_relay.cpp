// The token relay (router/src/token_relay.h) over the real DeepSeek-V3 tokenizer: max_tokens,
// stop strings across token boundaries, held-back text released at the finish, logprob texts.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "pd/common/check.h"
#include "pd/tokenizer/tokenizer.h"
#include "token_relay.h"

namespace pd::router {
namespace {

// DeepSeek-V3 ids: "Hello" "," " world" "!".
constexpr TokenId kHello = 19923;
constexpr TokenId kComma = 14;
constexpr TokenId kWorld = 2058;
constexpr TokenId kBang = 3;

const tokenizer::Tokenizer& deepseek() {
  static const auto t = [] {
    auto loaded = tokenizer::Tokenizer::load(PD_TOKENIZER_DIR);
    PD_CHECK_MSG(loaded.ok(), "the DeepSeek-V3 tokenizer is missing: run scripts/fetch-tokenizer.sh");
    return std::make_unique<tokenizer::Tokenizer>(std::move(loaded).value());
  }();
  return *t;
}

GenerationRequest request(std::int64_t max_tokens, std::vector<std::string> stop = {}, bool logprobs = false) {
  GenerationRequest r;
  r.max_tokens = max_tokens;
  r.stop = std::move(stop);
  r.logprobs = logprobs;
  return r;
}

TEST(TokenRelay, TextFlowsAndMaxTokensDropsTheRest) {
  TokenRelay relay(deepseek(), request(3));
  EXPECT_FALSE(relay.committed());
  const std::vector<TokenId> first{kHello, kComma};
  auto a = relay.push(first, {});
  ASSERT_TRUE(a.delta);
  EXPECT_EQ(a.delta->text, "Hello,");
  EXPECT_EQ(a.delta->token_ids, first);
  EXPECT_TRUE(relay.committed());
  const std::vector<TokenId> second{kWorld, kBang};
  auto b = relay.push(second, {});
  ASSERT_TRUE(b.delta);
  EXPECT_EQ(b.delta->token_ids, std::vector<TokenId>{kWorld});  // the fourth id is past max_tokens
  EXPECT_EQ(b.delta->text, " world");
  EXPECT_FALSE(relay.push(std::vector<TokenId>{kBang}, {}).delta);
  auto end = relay.finish(FinishReason::Length);
  EXPECT_FALSE(end.stop_matched);
  EXPECT_EQ(end.event.end.reason, FinishReason::Length);
  EXPECT_EQ(end.event.text, "");
}

TEST(TokenRelay, StopStringAcrossTokensCutsTheTextExactly) {
  TokenRelay relay(deepseek(), request(16, {"lo, w"}));
  auto a = relay.push(std::vector<TokenId>{kHello}, {});
  ASSERT_TRUE(a.delta);
  EXPECT_EQ(a.delta->text, "Hel");  // "lo" may start the stop string: held back
  EXPECT_FALSE(a.stop_matched);
  auto b = relay.push(std::vector<TokenId>{kComma, kWorld, kBang}, {});
  EXPECT_TRUE(b.stop_matched);
  ASSERT_TRUE(b.delta);
  EXPECT_EQ(b.delta->text, "");
  EXPECT_EQ(b.delta->token_ids, (std::vector<TokenId>{kComma, kWorld}));  // nothing after the match
}

TEST(TokenRelay, HeldBackTextIsReleasedAtTheFinishOrMatchesThere) {
  TokenRelay released(deepseek(), request(16, {"!?"}));
  auto a = released.push(std::vector<TokenId>{kHello, kBang}, {});
  ASSERT_TRUE(a.delta);
  EXPECT_EQ(a.delta->text, "Hello");  // "!" may start "!?"
  auto end = released.finish(FinishReason::Stop);
  EXPECT_FALSE(end.stop_matched);
  EXPECT_EQ(end.event.text, "!");
  EXPECT_EQ(end.event.end.reason, FinishReason::Stop);

  TokenRelay matched(deepseek(), request(16, {"!"}));
  auto b = matched.push(std::vector<TokenId>{kHello, kBang}, {});
  EXPECT_TRUE(b.stop_matched);
  ASSERT_TRUE(b.delta);
  EXPECT_EQ(b.delta->text, "Hello");
  EXPECT_EQ(TokenRelay::stopped().text, "");
}

TEST(TokenRelay, LogprobsCarryTheTextOfEachTokenAndAlternative) {
  TokenRelay relay(deepseek(), request(16, {}, /*logprobs=*/true));
  const std::vector<SampledToken> lps{{kHello, -0.5F, {{kHello, -0.5F}, {kWorld, -2.0F}}}};
  auto a = relay.push(std::vector<TokenId>{kHello}, lps);
  ASSERT_TRUE(a.delta);
  ASSERT_EQ(a.delta->logprobs.size(), 1U);
  EXPECT_EQ(a.delta->logprobs[0].sampled, lps[0]);
  EXPECT_EQ(a.delta->logprobs[0].text, "Hello");
  EXPECT_EQ(a.delta->logprobs[0].top_text, (std::vector<std::string>{"Hello", " world"}));

  TokenRelay without(deepseek(), request(16));
  auto b = without.push(std::vector<TokenId>{kHello}, lps);
  ASSERT_TRUE(b.delta);
  EXPECT_TRUE(b.delta->logprobs.empty());  // not asked for
}

TEST(TokenRelay, IncludeStopStrInOutputEndsTheTextAfterTheMatch) {
  GenerationRequest r = request(16, {"lo, w", "lo"});
  r.include_stop_str_in_output = true;
  TokenRelay relay(deepseek(), r);
  auto a = relay.push(std::vector<TokenId>{kHello, kComma, kWorld, kBang}, {});
  EXPECT_TRUE(a.stop_matched);
  ASSERT_TRUE(a.delta);
  // "lo" matches first (within "Hello"); the text keeps it and nothing after it.
  EXPECT_EQ(a.delta->text, "Hello");
  EXPECT_EQ(a.delta->token_ids, std::vector<TokenId>{kHello});

  GenerationRequest longer = request(16, {", w", ", world!"});
  longer.include_stop_str_in_output = true;
  TokenRelay both(deepseek(), longer);
  auto b = both.push(std::vector<TokenId>{kHello, kComma, kWorld, kBang}, {});
  EXPECT_TRUE(b.stop_matched);
  ASSERT_TRUE(b.delta);
  EXPECT_EQ(b.delta->text, "Hello, w");  // the earliest match, complete as soon as it is seen
}

TEST(TokenRelay, SkipSpecialTokensDecidesWhetherSpecialTokensAddText) {
  const TokenId eos = 1;  // <｜end▁of▁sentence｜>
  ASSERT_TRUE(deepseek().isSpecial(eos));
  TokenRelay skipping(deepseek(), request(16, {}, /*logprobs=*/true));
  const std::vector<SampledToken> lps{{kHello, -0.1F, {}}, {eos, -0.2F, {}}};
  auto a = skipping.push(std::vector<TokenId>{kHello, eos}, lps);
  ASSERT_TRUE(a.delta);
  EXPECT_EQ(a.delta->text, "Hello");
  ASSERT_EQ(a.delta->logprobs.size(), 2U);
  EXPECT_EQ(a.delta->logprobs[1].text, "<｜end▁of▁sentence｜>");  // a logprob entry always names its token

  GenerationRequest r = request(16);
  r.skip_special_tokens = false;
  TokenRelay keeping(deepseek(), r);
  auto b = keeping.push(std::vector<TokenId>{kHello, eos}, {});
  ASSERT_TRUE(b.delta);
  EXPECT_EQ(b.delta->text + keeping.finish(FinishReason::Stop).event.text, "Hello<｜end▁of▁sentence｜>");
}

}  // namespace
}  // namespace pd::router
