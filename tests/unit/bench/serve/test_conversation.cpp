// bench serve's prefix-reuse workloads (conversation.h) against a scripted OpenAI-compatible
// server over real HTTP: turn t's answer is part of turn t + 1's prompt, conversations share the
// system prompt, shared-prefix requests share their prefix; and the hit-rate and TTFT arithmetic.
#include <gtest/gtest.h>

#include <boost/json.hpp>
#include <map>

#include "bench/serve/conversation.h"
#include "scripted_openai_server.h"

namespace pd::bench {
namespace {

using namespace std::chrono_literals;

std::vector<std::int64_t> promptOf(const std::string& body) {
  std::vector<std::int64_t> out;
  const boost::json::value doc = boost::json::parse(body);
  for (const auto& t : doc.at("prompt").as_array()) out.push_back(t.as_int64());
  return out;
}

bool startsWith(const std::vector<std::int64_t>& v, const std::vector<std::int64_t>& prefix) {
  return v.size() >= prefix.size() && std::equal(prefix.begin(), prefix.end(), v.begin());
}

TEST(BenchServeConversation, EachTurnExtendsThePreviousPromptAndAnswer) {
  test::Script script;
  script.ttft_ms = 1;
  script.gap_ms = 1;
  test::ScriptedOpenAiServer server(script);
  ConversationOptions o;
  o.model = "scripted-model";
  o.conversations = 3;
  o.turns = 3;
  o.system_tokens = 20;
  o.turn_tokens = 5;
  o.concurrency = 2;
  o.timeout = 20s;
  auto requests = runConversations(parseUrl(server.url()).value(), o);
  ASSERT_TRUE(requests.ok()) << requests.error().toString();
  ASSERT_EQ(requests->size(), 9u);
  // The scripted answer's token ids, in chunk order: first ids 100, 101, ... per chunk.
  std::map<std::int64_t, std::vector<std::vector<std::int64_t>>> by_conversation;
  std::vector<std::int64_t> system;
  for (const auto& body : server.bodies()) {
    const auto prompt = promptOf(body);
    if (system.empty()) system.assign(prompt.begin(), prompt.begin() + 20);
    EXPECT_TRUE(startsWith(prompt, system)) << "every conversation starts with the shared system prompt";
  }
  for (const auto& r : *requests) {
    EXPECT_TRUE(r.result.ok) << r.result.error;
    EXPECT_EQ(static_cast<int>(r.result.token_ids.size()), server.totalTokens());
  }
  // Per conversation (bodies of one conversation arrive in turn order): prompt t+1 = prompt t +
  // answer t + 5 new tokens.
  const auto bodies = server.bodies();
  std::vector<std::vector<std::int64_t>> prompts;
  for (const auto& b : bodies) prompts.push_back(promptOf(b));
  int continued = 0;
  for (const auto& next : prompts) {
    for (const auto& prev : prompts) {
      if (next.size() != prev.size() + static_cast<std::size_t>(server.totalTokens()) + 5 || !startsWith(next, prev)) {
        continue;
      }
      // The answer between them is the one the server sent for `prev`.
      const auto& answer = (*requests)[0].result.token_ids;  // every scripted answer is the same
      EXPECT_TRUE(std::equal(answer.begin(), answer.end(), next.begin() + static_cast<std::ptrdiff_t>(prev.size())));
      ++continued;
    }
  }
  EXPECT_EQ(continued, 6) << "3 conversations x 2 later turns";
  // Reusable tokens: the previous turn's prompt.
  for (const auto& r : *requests) {
    const std::int64_t expected = r.index == 0 ? 0 : r.index == 1 ? 25 : 25 + server.totalTokens() + 5;
    EXPECT_EQ(r.reusable_tokens, expected) << "turn " << r.index;
  }
}

// With the prefill workers' pages the multiturn workload runs in two phases, so the bytes counted
// between its scrapes are the later turns' only: every first turn is answered before the callback
// and no later turn has been sent yet.
TEST(BenchServeConversation, TwoPhasesRunEveryFirstTurnBeforeAnyLaterTurn) {
  test::Script script;
  script.ttft_ms = 1;
  script.gap_ms = 1;
  test::ScriptedOpenAiServer server(script);
  ConversationOptions o;
  o.model = "scripted-model";
  o.conversations = 4;
  o.turns = 3;
  o.system_tokens = 8;
  o.turn_tokens = 4;
  o.concurrency = 3;
  o.timeout = 20s;
  int calls = 0;
  std::size_t bodies_then = 0;
  o.after_first_turns = [&] {
    ++calls;
    bodies_then = server.bodies().size();
  };
  auto requests = runConversations(parseUrl(server.url()).value(), o);
  ASSERT_TRUE(requests.ok()) << requests.error().toString();
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(bodies_then, 4u);
  ASSERT_EQ(requests->size(), 12u);
  for (const auto& r : *requests) {
    EXPECT_TRUE(r.result.ok) << r.result.error;
    // Histories survive the phase boundary: turn 1 reuses turn 0's 12-token prompt.
    if (r.index == 1) {
      EXPECT_EQ(r.reusable_tokens, 12);
    }
  }
  const std::vector<std::string> bodies = server.bodies();
  ASSERT_EQ(bodies.size(), 12u);
  for (std::size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(promptOf(bodies[i]).size(), 12u) << "only first turns before the callback";
  }
}

TEST(BenchServeConversation, SharedPrefixRequestsShareTheirPrefix) {
  test::Script script;
  script.ttft_ms = 1;
  script.gap_ms = 1;
  test::ScriptedOpenAiServer server(script);
  ConversationOptions o;
  o.workload = "shared-prefix";
  o.model = "scripted-model";
  o.prefixes = 2;
  o.prefix_tokens = 30;
  o.suffix_tokens = 4;
  o.requests_per_prefix = 3;
  o.concurrency = 1;
  o.timeout = 20s;
  auto requests = runConversations(parseUrl(server.url()).value(), o);
  ASSERT_TRUE(requests.ok());
  ASSERT_EQ(requests->size(), 6u);
  const auto bodies = server.bodies();
  ASSERT_EQ(bodies.size(), 6u);
  // Interleaved: prefix 0, prefix 1, prefix 0, ...
  const auto p0 = promptOf(bodies[0]);
  const auto p1 = promptOf(bodies[1]);
  EXPECT_FALSE(std::equal(p0.begin(), p0.begin() + 30, p1.begin()));
  for (std::size_t i = 0; i < bodies.size(); ++i) {
    const auto p = promptOf(bodies[i]);
    EXPECT_EQ(p.size(), 34u);
    const auto& same = i % 2 == 0 ? p0 : p1;
    EXPECT_TRUE(std::equal(same.begin(), same.begin() + 30, p.begin())) << i;
  }
  EXPECT_FALSE(runConversations(parseUrl(server.url()).value(), ConversationOptions{.workload = "nope"}).ok());
}

ConversationRequest made(std::int64_t index, std::int64_t reusable, std::int64_t cached, double ttft_s) {
  ConversationRequest r;
  r.index = index;
  r.reusable_tokens = reusable;
  r.result.ok = true;
  r.result.cached_tokens = cached;
  r.result.ttft_s = ttft_s;
  r.result.e2e_s = ttft_s * 2;
  r.result.prompt_tokens = reusable + 10;
  return r;
}

TEST(BenchServeConversation, HitRatesAndTheTtftRatio) {
  std::vector<ConversationRequest> main{made(0, 0, 0, 0.100), made(1, 100, 96, 0.010), made(2, 200, 0, 0.050),
                                        made(1, 100, 64, 0.020)};
  ConversationRequest failed;
  failed.index = 1;
  main.push_back(failed);
  const ConversationStats s = summarizeConversations(main, 2.0);
  EXPECT_EQ(s.requests, 5);
  EXPECT_EQ(s.failed, 1);
  EXPECT_EQ(s.later_requests, 3);
  EXPECT_DOUBLE_EQ(*s.prefix_hit_rate, 160.0 / 400.0);
  EXPECT_DOUBLE_EQ(*s.request_hit_rate, 2.0 / 3.0);
  EXPECT_DOUBLE_EQ(s.ttft_p50_later_ms, 20.0);
  EXPECT_DOUBLE_EQ(s.ttft_p50_first_ms, 100.0);
  const ConversationStats base = summarizeConversations({made(0, 0, 0, 0.1), made(1, 100, 0, 0.080)}, 1.0);
  ConversationOptions o;
  const auto doc = boost::json::parse(conversationReportJson(o, "http://a", s, "http://b", base)).as_object();
  EXPECT_DOUBLE_EQ(doc.at("prefix_hit_rate").as_double(), 0.4);
  EXPECT_DOUBLE_EQ(doc.at("multiturn_ttft_ratio").as_double(), 20.0 / 80.0);
  EXPECT_TRUE(doc.at("transfer_bytes_ratio").is_null());  // no pages scraped
  // Bytes per later turn: 3 later turns put 3,000 bytes; the baseline's one put 4,000.
  ConversationStats with_bytes = s;
  with_bytes.later_transfer_bytes = 3000.0;
  ConversationStats base_bytes = base;
  base_bytes.later_transfer_bytes = 4000.0;
  const auto bytes_doc =
      boost::json::parse(conversationReportJson(o, "http://a", with_bytes, "http://b", base_bytes)).as_object();
  EXPECT_DOUBLE_EQ(bytes_doc.at("transfer_bytes_ratio").as_double(), 1000.0 / 4000.0);
  EXPECT_DOUBLE_EQ(bytes_doc.at("transfer_bytes_per_later_turn").as_double(), 1000.0);
  EXPECT_DOUBLE_EQ(bytes_doc.at("main").at("later_transfer_bytes").as_double(), 3000.0);
  EXPECT_EQ(doc.at("baseline").at("request_hit_rate").as_double(), 0.0);
  // Without a baseline the ratio is null.
  const auto alone = boost::json::parse(conversationReportJson(o, "http://a", s, "", std::nullopt)).as_object();
  EXPECT_TRUE(alone.at("multiturn_ttft_ratio").is_null());
}

}  // namespace
}  // namespace pd::bench
