// `pdserve router` as a process (tools/pdserve/cmd_router.cpp) in front of fake prefill and
// decode workers served by this test (tests/fakes/fake_workers.h): --check-config, the
// PDSERVE_READY line, /ready following the workers, a completion through real HTTP and the real
// DeepSeek-V3 tokenizer, and a SIGTERM drain with a request in flight: /ready turns 503 at once,
// the in-flight request still finishes, and the process exits 0. Clients hanging up at every
// stage of a request's life, thousands of times, leave the router alive and every decode request
// ended. Per-API-key limits answer 429 with Retry-After through the real process.
#include <gtest/gtest.h>
#include <signal.h>

#include <boost/json.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <fstream>
#include <future>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "fakes/fake_workers.h"
#include "fakes/raw_http_peer.h"
#include "pd/common/http_client.h"
#include "pd/common/subprocess.h"
#include "support/test_files.h"

namespace pd {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

const std::string kModel = std::string(PD_TEST_DATA_DIR) + "/golden/tiny-bf16";

std::unique_ptr<proc::Subprocess> spawnRouter(std::vector<std::string> extra, bool capture_stderr) {
  proc::SpawnOptions o;
  o.argv = {PD_PDSERVE_BIN, "router", "--model.path", kModel, "--model.tokenizer", PD_TOKENIZER_DIR};
  o.argv.insert(o.argv.end(), extra.begin(), extra.end());
  o.capture_stderr = capture_stderr;
  auto p = proc::Subprocess::spawn(o);
  PD_CHECK_MSG(p.ok(), "cannot spawn pdserve");
  return std::move(p).value();
}

std::optional<int> status(std::uint16_t port, const std::string& target) {
  http::Client client("127.0.0.1", port);
  auto r = client.send({"GET", target, {}, {}}, 5s);
  if (!r.ok()) return std::nullopt;
  return r.value().status;
}

template <class Pred>
bool waitFor(Pred pred, std::chrono::milliseconds timeout) {
  const auto until = Clock::now() + timeout;
  while (Clock::now() < until) {
    if (pred()) return true;
    std::this_thread::sleep_for(10ms);
  }
  return pred();
}

TEST(RouterProcess, CheckConfigValidatesWithoutServing) {
  auto ok = spawnRouter({"--check-config", "--router.decode-workers", "127.0.0.1:9,127.0.0.1:10",
                         "--router.prefill-service", "prefill.pd.svc:8200"},
                        true);
  proc::LineReader out(ok->stdoutFd());
  EXPECT_EQ(ok->wait(30s), std::optional<int>(0));
  EXPECT_EQ(out.next(1s), std::nullopt) << "--check-config printed something";

  auto none = spawnRouter({"--check-config"}, true);
  proc::LineReader err(none->stderrFd());
  EXPECT_EQ(none->wait(30s), std::optional<int>(2));
  const auto line = err.next(5s);
  ASSERT_TRUE(line.has_value());
  EXPECT_NE(line->find("no prefill workers"), std::string::npos) << *line;

  auto bad =
      spawnRouter({"--check-config", "--router.decode-workers", "nohost", "--router.prefill-workers", "a:1"}, false);
  EXPECT_EQ(bad->wait(30s), std::optional<int>(2));
}

/// A router in front of one fake decode and one fake prefill worker, ready to serve.
struct RouterWithFakes {
  fakes::FakeDecodeWorker d;
  std::vector<fakes::FakeDecodeWorker*> decoders{&d};
  fakes::FakePrefillWorker p{decoders};
  std::unique_ptr<proc::Subprocess> router;
  std::uint16_t port = 0;

  bool start() {
    router = spawnRouter({"--router.port", "0", "--router.decode-workers", d.address(), "--router.prefill-workers",
                          p.address(), "--router.health-interval-ms", "50"},
                         false);
    proc::LineReader out(router->stdoutFd());
    const auto line = out.next(60s);
    const std::string prefix = "PDSERVE_READY role=router url=http://127.0.0.1:";
    if (!line || line->rfind(prefix, 0) != 0) return false;
    port = static_cast<std::uint16_t>(std::stoi(line->substr(prefix.size())));
    return waitFor([&] { return status(port, "/ready") == std::optional<int>(200); }, 10s);
  }
};

std::string chatRequest(bool stream) {
  const std::string body = std::string(R"({"model":"pdserve-default","messages":[{"role":"user","content":"Hi"}],)") +
                           R"("max_tokens":64,"stream":)" + (stream ? "true" : "false") + "}";
  return "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: " +
         std::to_string(body.size()) + "\r\n\r\n" + body;
}

/// Opens `n` connections that each send `request`, waits until `reached` says the router got them
/// that far, then hangs all of them up at once.
template <class Pred>
::testing::AssertionResult hangUpBatch(std::uint16_t port, std::size_t n, const std::string& request, Pred reached) {
  std::deque<fakes::RawHttpPeer> peers;
  for (std::size_t i = 0; i < n; ++i) {
    peers.emplace_back(port);
    if (!peers.back().send(request)) return ::testing::AssertionFailure() << "send failed";
  }
  if (!waitFor(reached, 20s)) return ::testing::AssertionFailure() << "the requests did not reach the stage";
  for (auto& peer : peers) peer.close();
  return ::testing::AssertionSuccess();
}

/// How many times over the hang-up stages run: PD_TEST_HANGUP_ROUNDS (default 1, about 3,100
/// hang-ups; 4 gives the issue's 10,000+ once, outside CI).
int hangUpRounds() {
  const char* v = std::getenv("PD_TEST_HANGUP_ROUNDS");
  const int n = v != nullptr ? std::atoi(v) : 1;
  return n >= 1 ? n : 1;
}

TEST(RouterProcess, SurvivesClientsHangingUpAtEveryStage) {
  const int rounds = hangUpRounds();
  RouterWithFakes c;
  fakes::DecodeScript script;
  script.tokens = {{19923}, {14}, {2058}, {3}};  // "Hello, world!"
  script.finish_reason = pd::FinishReason::Stop;
  c.d.setScript(script);
  ASSERT_TRUE(c.start());
  const std::string whole = chatRequest(false);
  std::size_t hangups = 0;

  for (int round = 0; round < rounds; ++round) {
    script.tokens = {{19923}, {14}, {2058}, {3}};
    script.token_delay = 0ms;
    c.d.setScript(script);
    // 1. Before the body: headers and half the body, then gone (no generation starts).
    for (int i = 0; i < 1000; ++i, ++hangups) {
      fakes::RawHttpPeer peer(c.port);
      ASSERT_TRUE(peer.send(whole.substr(0, whole.size() - 20)));
    }
    // 2. Right after sending: the router is anywhere from parsing to opening the legs.
    for (int i = 0; i < 600; ++i, ++hangups) {
      fakes::RawHttpPeer peer(c.port);
      ASSERT_TRUE(peer.send(whole));
    }
    ASSERT_TRUE(waitFor([&] { return c.d.live() == 0; }, 20s)) << c.d.live() << " decode requests still held";
    // 3. During the prefill leg: the prefill hangs until cancelled.
    c.p.setBehaviour(fakes::PrefillBehaviour::Hang);
    for (int batch = 0; batch < 10; ++batch, hangups += 50) {
      const std::size_t before = c.p.submits().size();
      ASSERT_TRUE(hangUpBatch(c.port, 50, whole, [&] { return c.p.submits().size() >= before + 50; }));
    }
    ASSERT_TRUE(waitFor([&] { return c.d.live() == 0; }, 20s)) << c.d.live() << " decode requests still held";
    // 4. Between the descriptor and the first token: KV arrived, the first token is slow.
    c.p.setBehaviour(fakes::PrefillBehaviour::Ok);
    script.token_delay = 10s;
    c.d.setScript(script);
    for (int batch = 0; batch < 10; ++batch, hangups += 50) {
      const std::size_t before = c.p.submits().size();
      ASSERT_TRUE(hangUpBatch(c.port, 50, whole, [&] { return c.p.submits().size() >= before + 50; }));
    }
    ASSERT_TRUE(waitFor([&] { return c.d.live() == 0; }, 20s)) << c.d.live() << " decode requests still held";
    // 5. Mid-stream: the first chunk arrived, more are coming.
    script.tokens = std::vector<std::vector<pd::TokenId>>(200, std::vector<pd::TokenId>{14});
    script.token_delay = 5ms;
    c.d.setScript(script);
    const std::string streamed = chatRequest(true);
    for (int i = 0; i < 500; ++i, ++hangups) {
      fakes::RawHttpPeer peer(c.port);
      ASSERT_TRUE(peer.send(streamed));
      const std::string got = peer.readUntil("\"content\":\",\"");
      ASSERT_NE(got.find("\"content\":\",\""), std::string::npos) << got;
    }
    ASSERT_TRUE(waitFor([&] { return c.d.live() == 0; }, 20s)) << c.d.live() << " decode requests still held";
  }

  // The router is alive and serves.
  EXPECT_GE(hangups, 3000U * static_cast<std::size_t>(rounds));
  std::printf("hang-ups: %zu in %d round(s)\n", hangups, rounds);
  EXPECT_EQ(status(c.port, "/health"), std::optional<int>(200));
  script.tokens = {{19923}, {14}, {2058}, {3}};
  script.token_delay = 0ms;
  c.d.setScript(script);
  http::Client client("127.0.0.1", c.port);
  auto r = client.send({"POST",
                        "/v1/chat/completions",
                        {{"Content-Type", "application/json"}},
                        R"({"model":"pdserve-default","messages":[{"role":"user","content":"Hi"}],"max_tokens":8})"},
                       10s);
  ASSERT_TRUE(r.ok()) << r.error().toString();
  ASSERT_EQ(r.value().status, 200) << r.value().body;
  EXPECT_NE(r.value().body.find("Hello, world!"), std::string::npos) << r.value().body;
  EXPECT_FALSE(c.router->wait(0ms).has_value()) << "the router exited";
}

TEST(RouterProcess, ServesThroughTheWorkersThenDrainsOnSigterm) {
  fakes::FakeDecodeWorker d;
  std::vector<fakes::FakeDecodeWorker*> decoders{&d};
  fakes::FakePrefillWorker p(decoders);
  fakes::DecodeScript script;
  script.tokens = {{19923}, {14}, {2058}, {3}};  // "Hello, world!"
  script.finish_reason = pd::FinishReason::Stop;
  d.setScript(script);
  d.setStatusFails(true);  // not ready at first

  auto router = spawnRouter({"--router.port", "0", "--router.decode-workers", d.address(), "--router.prefill-workers",
                             p.address(), "--router.health-interval-ms", "20", "--router.drain-timeout-ms", "10000"},
                            false);
  proc::LineReader out(router->stdoutFd());
  const auto ready_line = out.next(60s);
  ASSERT_TRUE(ready_line.has_value()) << "no PDSERVE_READY line";
  const std::string prefix = "PDSERVE_READY role=router url=http://127.0.0.1:";
  ASSERT_EQ(ready_line->rfind(prefix, 0), 0U) << *ready_line;
  const auto port = static_cast<std::uint16_t>(std::stoi(ready_line->substr(prefix.size())));

  EXPECT_EQ(status(port, "/health"), std::optional<int>(200));
  EXPECT_EQ(status(port, "/ready"), std::optional<int>(503));  // no decode worker in rotation
  d.setStatusFails(false);
  ASSERT_TRUE(waitFor([&] { return status(port, "/ready") == std::optional<int>(200); }, 10s));

  http::Client client("127.0.0.1", port);
  const http::ClientRequest completion{"POST",
                                       "/v1/chat/completions",
                                       {{"Content-Type", "application/json"}},
                                       R"({"model":"pdserve-default","messages":[{"role":"user","content":"Hi"}],)"
                                       R"("max_tokens":8})"};
  auto r = client.send(completion, 10s);
  ASSERT_TRUE(r.ok()) << r.error().toString();
  ASSERT_EQ(r.value().status, 200) << r.value().body;
  const auto body = boost::json::parse(r.value().body).as_object();
  const auto& message = body.at("choices").as_array()[0].as_object().at("message").as_object();
  EXPECT_EQ(message.at("content").as_string(), "Hello, world!");
  // The chat went through the DeepSeek-V3 template: BOS, <｜User｜>, "Hi", <｜Assistant｜>.
  ASSERT_EQ(p.submits().size(), 1U);
  EXPECT_EQ(p.submits()[0].token_ids.front(), 0);
  EXPECT_EQ(p.submits()[0].token_ids.back(), 128804);

  // A slow request in flight when SIGTERM comes still finishes.
  script.token_delay = 300ms;
  d.setScript(script);
  auto in_flight = std::async(std::launch::async, [&] {
    http::Client c("127.0.0.1", port);
    return c.send(completion, 20s);
  });
  ASSERT_TRUE(waitFor([&] { return d.opens().size() == 2; }, 10s));
  ASSERT_TRUE(router->signal(SIGTERM));
  EXPECT_TRUE(waitFor([&] { return status(port, "/ready") != std::optional<int>(200); }, 2s));
  auto late = in_flight.get();
  ASSERT_TRUE(late.ok()) << late.error().toString();
  EXPECT_EQ(late.value().status, 200) << late.value().body;
  EXPECT_EQ(router->wait(15s), std::optional<int>(0));
  EXPECT_EQ(d.live(), 0U);
}

// Per-API-key limits through the real router process: with max_concurrent=1, the second of two
// concurrent requests of that key gets 429 with Retry-After and OpenAI's rate-limit error, and
// the key succeeds again once the first has finished. The first request is held by the fake
// decode worker (pause_after), so "concurrent" is by construction, not by timing.
TEST(RouterProcess, PerKeyConcurrencyLimitAnswers429WithRetryAfter) {
  test::TempDir dir;
  const auto keys = dir.path() / "api-keys";
  std::ofstream(keys) << "# keys with limits\nsk-limited max_concurrent=1\nsk-open\n";
  fakes::FakeDecodeWorker d;
  std::vector<fakes::FakeDecodeWorker*> decoders{&d};
  fakes::FakePrefillWorker p(decoders);
  fakes::DecodeScript script;
  script.tokens = {{19923}, {14}, {2058}, {3}};  // "Hello, world!"
  script.finish_reason = pd::FinishReason::Stop;
  script.pause_after = 1;
  d.setScript(script);
  auto router = spawnRouter(
      {"--router.port", "0", "--router.decode-workers", d.address(), "--router.prefill-workers", p.address(),
       "--router.health-interval-ms", "50", "--router.api-keys-file", keys.string(), "--router.retry-after-s", "3"},
      false);
  proc::LineReader out(router->stdoutFd());
  const auto line = out.next(60s);
  const std::string prefix = "PDSERVE_READY role=router url=http://127.0.0.1:";
  ASSERT_TRUE(line.has_value() && line->rfind(prefix, 0) == 0) << line.value_or("no PDSERVE_READY line");
  const auto port = static_cast<std::uint16_t>(std::stoi(line->substr(prefix.size())));
  ASSERT_TRUE(waitFor([&] { return status(port, "/ready") == std::optional<int>(200); }, 10s));

  const auto completion = [](const std::string& key) {
    return http::ClientRequest{"POST",
                               "/v1/chat/completions",
                               {{"Content-Type", "application/json"}, {"Authorization", "Bearer " + key}},
                               R"({"model":"pdserve-default","messages":[{"role":"user","content":"Hi"}],)"
                               R"("max_tokens":8})"};
  };
  auto first = std::async(std::launch::async, [&] {
    http::Client c("127.0.0.1", port);
    return c.send(completion("sk-limited"), 30s);
  });
  // The first request holds its key's slot: it is paused mid-stream at the decode worker.
  ASSERT_TRUE(waitFor([&] { return d.paused() == 1; }, 20s));

  http::Client client("127.0.0.1", port);
  auto second = client.send(completion("sk-limited"), 10s);
  ASSERT_TRUE(second.ok()) << second.error().toString();
  EXPECT_EQ(second->status, 429) << second->body;
  EXPECT_EQ(second->header("Retry-After"), "3");
  const auto error = boost::json::parse(second->body).as_object().at("error").as_object();
  EXPECT_EQ(error.at("type").as_string(), "requests");
  EXPECT_EQ(error.at("code").as_string(), "rate_limit_exceeded");
  EXPECT_EQ(d.opens().size(), 1U) << "the refused request never reached a worker";

  // Another key is not limited (its request runs to the end: the fake no longer pauses).
  d.resume();
  auto other = client.send(completion("sk-open"), 10s);
  ASSERT_TRUE(other.ok()) << other.error().toString();
  EXPECT_EQ(other->status, 200) << other->body;

  // The first finishes; its answer is out only after its slot is free, so the key works at once.
  auto done = first.get();
  ASSERT_TRUE(done.ok()) << done.error().toString();
  ASSERT_EQ(done->status, 200) << done->body;
  auto third = client.send(completion("sk-limited"), 10s);
  ASSERT_TRUE(third.ok()) << third.error().toString();
  EXPECT_EQ(third->status, 200) << third->body;
  const auto content = boost::json::parse(third->body)
                           .as_object()
                           .at("choices")
                           .as_array()[0]
                           .as_object()
                           .at("message")
                           .as_object()
                           .at("content")
                           .as_string();
  EXPECT_EQ(content, "Hello, world!");
  ASSERT_TRUE(router->signal(SIGTERM));
  EXPECT_EQ(router->wait(15s), std::optional<int>(0));
}

}  // namespace
}  // namespace pd
