// PdBackend against fake prefill and decode workers (real HTTP servers in this process):
// the whole request flow, stop strings, retries of each leg, aborts and deadlines, and the
// OpenAI front end on top of it.
#include <gtest/gtest.h>

#include <algorithm>
#include <boost/json.hpp>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <set>
#include <thread>

#include "fakes/fake_workers.h"
#include "pd/common/choices.h"
#include "pd/common/http_client.h"
#include "pd/router/api_server.h"
#include "pd/router/pd_backend.h"
#include "pd/router/tokenizer_prompt_renderer.h"
#include "pd/router/worker_registry.h"

namespace pd::router {
namespace {

using namespace std::chrono_literals;
using fakes::DecodeScript;
using fakes::FakeDecodeWorker;
using fakes::FakePrefillWorker;
using fakes::PrefillBehaviour;

// DeepSeek-V3 ids: "Hello" "," " world" "!".
constexpr std::int32_t kHello = 19923;
constexpr std::int32_t kComma = 14;
constexpr std::int32_t kWorld = 2058;
constexpr std::int32_t kBang = 3;

const TokenizerPromptRenderer& renderer() {
  static const auto r = [] {
    auto loaded = TokenizerPromptRenderer::load(PD_TOKENIZER_DIR);
    PD_CHECK_MSG(loaded.ok(), "the DeepSeek-V3 tokenizer is missing: run scripts/fetch-tokenizer.sh");
    return std::move(loaded).value();
  }();
  return *r;
}

template <class Pred>
bool waitFor(Pred pred, std::chrono::milliseconds timeout = 5000ms) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < until) {
    if (pred()) return true;
    std::this_thread::sleep_for(5ms);
  }
  return pred();
}

bool contains(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

class RecordingSink final : public TokenSink {
 public:
  void onTokens(TokenDelta delta) override {
    std::lock_guard lock(mu_);
    EXPECT_FALSE(ended_) << "tokens after the terminal event";
    for (auto id : delta.token_ids) ids_.push_back(id);
    text_ += delta.text;
    logprobs_ += delta.logprobs.size();
    ++deltas_;
  }
  void onFinish(FinishEvent end) override {
    std::lock_guard lock(mu_);
    EXPECT_FALSE(ended_) << "two terminal events";
    ended_ = true;
    text_ += end.text;
    reason_ = end.end.reason;
    cv_.notify_all();
  }
  void onError(Error error) override {
    std::lock_guard lock(mu_);
    EXPECT_FALSE(ended_) << "two terminal events";
    ended_ = true;
    error_ = std::move(error);
    cv_.notify_all();
  }
  /// Waits for the terminal event.
  bool waitEnd(std::chrono::milliseconds timeout = 10000ms) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, timeout, [&] { return ended_; });
  }
  std::string text() {
    std::lock_guard lock(mu_);
    return text_;
  }
  bool ended() {
    std::lock_guard lock(mu_);
    return ended_;
  }
  std::vector<TokenId> ids() {
    std::lock_guard lock(mu_);
    return ids_;
  }
  std::optional<Error> error() {
    std::lock_guard lock(mu_);
    return error_;
  }
  std::optional<FinishReason> reason() {
    std::lock_guard lock(mu_);
    return ended_ && !error_ ? std::optional<FinishReason>(reason_) : std::nullopt;
  }
  std::size_t logprobs() {
    std::lock_guard lock(mu_);
    return logprobs_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<TokenId> ids_;
  std::string text_;
  std::size_t logprobs_ = 0;
  int deltas_ = 0;
  bool ended_ = false;
  FinishReason reason_ = FinishReason::Stop;
  std::optional<Error> error_;
};

/// Two decode and two prefill fakes, a registry polling them, and the backend.
class PdBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Make the policies' first choices predictable: d1 and p1 look least loaded.
    auto s = d2.status();
    s.free_blocks = 50;
    d2.setStatus(s);
    auto ps = p2.status();
    ps.queued_tokens = 1000;
    p2.setStatus(ps);
  }

  /// `health_interval` and `health_failures` as the registry's (a long interval with one failure
  /// lets a test see every reportFailure: the worker stays out of rotation until the next poll).
  void startBackend(PdBackendOptions options = {}, std::chrono::milliseconds health_interval = 20ms,
                    std::int64_t health_failures = 2) {
    RegistryOptions ro;
    for (auto* d : decoders) ro.decode_workers.push_back(parseWorkerAddress(d->address(), "test").value());
    ro.prefill_workers.push_back(parseWorkerAddress(p1.address(), "test").value());
    ro.prefill_workers.push_back(parseWorkerAddress(p2.address(), "test").value());
    ro.health_interval = health_interval;
    ro.health_timeout = 500ms;
    ro.health_failures = health_failures;
    registry = WorkerRegistry::start(ro).value();
    ASSERT_TRUE(waitFor([&] {
      return registry->ready(WorkerRole::Decode).size() == 2 && registry->ready(WorkerRole::Prefill).size() == 2;
    }));
    if (options.abort_timeout == PdBackendOptions{}.abort_timeout) options.abort_timeout = 1000ms;
    auto b = PdBackend::create(options, *registry, renderer().tokenizer(), metrics);
    ASSERT_TRUE(b.ok()) << b.error().toString();
    backend = std::move(b).value();
  }

  /// Sets d1's status and waits until the registry's ready view of d1 satisfies `seen`.
  [[nodiscard]] bool setD1Status(const worker_api::WorkerStatus& status,
                                 const std::function<bool(const worker_api::WorkerStatus&)>& seen) {
    d1.setStatus(status);
    return waitFor([&] {
      for (const auto& w : registry->ready(WorkerRole::Decode)) {
        if (w.address.key() == d1.address() && seen(w.status)) return true;
      }
      return false;
    });
  }

  /// d1 answers "Hello!"; prompts shorter than 3 tokens are prefilled by the decode worker.
  void startWithLocalPrefillBelow3Tokens() {
    DecodeScript script;
    script.tokens = {{kHello}, {kBang}};
    d1.setScript(script);
    PdBackendOptions o;
    o.remote_prefill_min_tokens = 3;
    startBackend(o);
  }

  /// pdserve_router_prefills_total{where, reason}.
  double prefills(const std::string& where, const std::string& reason) {
    return metrics.counter("pdserve_router_prefills_total", "", {"where", "reason"}).labels({where, reason}).value();
  }

  /// Runs `r` to its end; the sink (check its error).
  std::shared_ptr<RecordingSink> runToEnd(const GenerationRequest& r) {
    auto sink = std::make_shared<RecordingSink>();
    const auto started = backend->start(r, sink);
    EXPECT_TRUE(started.ok()) << started.error().toString();
    EXPECT_TRUE(sink->waitEnd());
    return sink;
  }

  GenerationRequest request(std::string id = "cmpl-t1") {
    GenerationRequest g;
    g.request_id = std::move(id);
    g.prompt_token_ids = {0, static_cast<TokenId>(kHello)};
    g.max_tokens = 16;
    g.sampling.temperature = 0.0;
    g.deadline = std::chrono::steady_clock::now() + 20s;
    return g;
  }

  /// One recording sink per choice of an n-choice generation.
  static std::vector<std::shared_ptr<RecordingSink>> recordingSinks(int n) {
    std::vector<std::shared_ptr<RecordingSink>> sinks;
    for (int i = 0; i < n; ++i) sinks.push_back(std::make_shared<RecordingSink>());
    return sinks;
  }
  /// Every prefill submit either prefill worker received.
  std::vector<worker_api::PrefillSubmit> allSubmits() const {
    auto submits = p1.submits();
    for (auto& s : p2.submits()) submits.push_back(s);
    return submits;
  }

  double retries(const std::string& leg) {
    return metrics.counter("pdserve_router_retries_total", "", {"leg"}).labels({leg}).value();
  }
  double resumes(const std::string& cause) {
    return metrics.counter("pdserve_router_resumes_total", "", {"cause"}).labels({cause}).value();
  }

  void TearDown() override {
    backend.reset();
    if (backend_was_idle_check_) {
      // The backend closed every decode stream; a fake worker sees the close on its own io
      // thread, so wait for that event rather than expecting it already.
      EXPECT_TRUE(waitFor([&] { return d1.live() == 0 && d2.live() == 0; }))
          << "decode streams still open: " << d1.live() << " and " << d2.live();
    }
  }

  FakeDecodeWorker d1;
  FakeDecodeWorker d2;
  std::vector<FakeDecodeWorker*> decoders{&d1, &d2};
  FakePrefillWorker p1{decoders};
  FakePrefillWorker p2{decoders};
  metrics::Registry metrics;
  std::unique_ptr<WorkerRegistry> registry;
  std::unique_ptr<PdBackend> backend;
  bool backend_was_idle_check_ = true;
};

TEST_F(PdBackendTest, CompletionFlowsDetokenizedWithTheSameSamplingOnBothLegs) {
  DecodeScript script;
  script.tokens = {{kHello}, {kComma}, {kWorld, kBang}};
  script.finish_reason = pd::FinishReason::Stop;
  d1.setScript(script);
  startBackend();
  auto sink = std::make_shared<RecordingSink>();
  auto req = request();
  req.logprobs = true;
  req.sampling.top_logprobs = 1;
  req.stop_token_ids = {7};
  auto control = backend->start(req, sink);
  ASSERT_TRUE(control.ok()) << control.error().toString();
  ASSERT_TRUE(sink->waitEnd());
  ASSERT_FALSE(sink->error()) << sink->error()->toString();
  EXPECT_EQ(sink->text(), "Hello, world!");
  EXPECT_EQ(sink->ids(), (std::vector<TokenId>{19923, 14, 2058, 3}));
  EXPECT_EQ(sink->reason(), FinishReason::Stop);
  EXPECT_EQ(sink->logprobs(), 4U);

  const auto opens = d1.opens();
  ASSERT_EQ(opens.size(), 1U);
  EXPECT_TRUE(d2.opens().empty());
  EXPECT_EQ(opens[0].request_id, "cmpl-t1");
  EXPECT_EQ(opens[0].prompt_tokens, 2);
  EXPECT_EQ(opens[0].max_tokens, 16);
  EXPECT_EQ(opens[0].prefill_attempts, 2);  // default prefill_retries = 1
  EXPECT_TRUE(opens[0].logprobs);
  EXPECT_EQ(opens[0].sampling.top_logprobs, 1);
  EXPECT_EQ(opens[0].stop_token_ids, (std::vector<std::int32_t>{7}));
  const auto submits = p1.submits();
  ASSERT_EQ(submits.size(), 1U);
  EXPECT_TRUE(p2.submits().empty());
  EXPECT_EQ(submits[0].request_id, "cmpl-t1");
  EXPECT_EQ(submits[0].token_ids, (std::vector<std::int32_t>{0, kHello}));
  EXPECT_EQ(submits[0].kv_descriptor, "fake-kv:" + std::to_string(d1.port()) + ":cmpl-t1");
  // No client seed: the router chose one, the same for both legs.
  EXPECT_EQ(submits[0].sampling.seed, opens[0].sampling.seed);
  EXPECT_EQ(retries("prefill"), 0.0);
  EXPECT_EQ(retries("decode"), 0.0);
}

TEST_F(PdBackendTest, ClientSeedReachesBothLegsAndLengthFinishes) {
  startBackend();
  auto sink = std::make_shared<RecordingSink>();
  auto req = request();
  req.seed = 42;
  req.sampling.temperature = 0.7;
  ASSERT_TRUE(backend->start(req, sink).ok());
  ASSERT_TRUE(sink->waitEnd());
  EXPECT_EQ(sink->reason(), FinishReason::Length);
  ASSERT_EQ(d1.opens().size(), 1U);
  ASSERT_EQ(p1.submits().size(), 1U);
  EXPECT_EQ(d1.opens()[0].sampling.seed, 42U);
  EXPECT_EQ(p1.submits()[0].sampling.seed, 42U);
  EXPECT_DOUBLE_EQ(p1.submits()[0].sampling.temperature, 0.7);
}

TEST_F(PdBackendTest, StopStringCutsTheTextExactlyAndAbortsTheDecodeStream) {
  DecodeScript script;
  script.tokens = {{kHello}, {kComma}, {kWorld}, {kBang}, {kHello}, {kHello}};
  script.token_delay = 20ms;
  d1.setScript(script);
  startBackend();
  auto sink = std::make_shared<RecordingSink>();
  auto req = request();
  req.stop = {", wor"};
  ASSERT_TRUE(backend->start(req, sink).ok());
  ASSERT_TRUE(sink->waitEnd());
  ASSERT_FALSE(sink->error());
  EXPECT_EQ(sink->text(), "Hello");
  EXPECT_EQ(sink->ids(), (std::vector<TokenId>{19923, 14, 2058}));
  EXPECT_EQ(sink->reason(), FinishReason::Stop);
  // The stream was closed before its end: D saw the client go (or the abort) and freed the request.
  EXPECT_TRUE(waitFor([&] { return contains(d1.gone(), "cmpl-t1") || contains(d1.aborts(), "cmpl-t1"); }));
  EXPECT_TRUE(waitFor([&] { return d1.live() == 0; }));
}

TEST_F(PdBackendTest, StopStringAcrossTheLastTokenAndTextHeldBackIsReleasedAtTheEnd) {
  DecodeScript script;
  script.tokens = {{kHello}, {kComma}};
  script.finish_reason = pd::FinishReason::Length;
  d1.setScript(script);
  startBackend();
  auto sink = std::make_shared<RecordingSink>();
  auto req = request();
  req.stop = {", world"};  // "," is held back as a possible start, then released at the end
  ASSERT_TRUE(backend->start(req, sink).ok());
  ASSERT_TRUE(sink->waitEnd());
  EXPECT_EQ(sink->text(), "Hello,");
  EXPECT_EQ(sink->reason(), FinishReason::Length);
}

TEST_F(PdBackendTest, PrefillFailureIsRetriedOnTheOtherPrefillWorkerWhileDecodeKeepsItsBlocks) {
  p1.setBehaviour(PrefillBehaviour::Fail);
  DecodeScript script;
  script.tokens = {{kHello}, {kBang}};
  d1.setScript(script);
  startBackend();
  auto sink = std::make_shared<RecordingSink>();
  ASSERT_TRUE(backend->start(request(), sink).ok());
  ASSERT_TRUE(sink->waitEnd());
  ASSERT_FALSE(sink->error()) << sink->error()->toString();
  EXPECT_EQ(sink->text(), "Hello!");
  ASSERT_EQ(p1.submits().size(), 1U);
  ASSERT_EQ(p2.submits().size(), 1U);
  EXPECT_EQ(p1.submits()[0].kv_descriptor, p2.submits()[0].kv_descriptor);  // the same blocks
  EXPECT_EQ(d1.opens().size(), 1U);
  EXPECT_EQ(d1.opens()[0].prefill_attempts, 2);
  EXPECT_TRUE(d2.opens().empty());
  EXPECT_EQ(retries("prefill"), 1.0);
  EXPECT_EQ(retries("decode"), 0.0);
}

// The KV cannot reach the chosen decode worker (its link is cut; its HTTP stream stays up): once
// the prefill attempts into it are spent, the attempt is retried on another decode worker instead
// of failing the request.
TEST_F(PdBackendTest, DecodeWorkerTheKvCannotReachIsRetriedOnAnother) {
  p1.addUnreachable(&d1);
  p2.addUnreachable(&d1);
  DecodeScript never;  // d1 would stream, but its KV never arrives
  never.tokens = {{kHello}};
  d1.setScript(never);
  DecodeScript ok;
  ok.tokens = {{kHello}, {kBang}};
  d2.setScript(ok);
  startBackend();
  auto sink = std::make_shared<RecordingSink>();
  ASSERT_TRUE(backend->start(request(), sink).ok());
  ASSERT_TRUE(sink->waitEnd());
  ASSERT_FALSE(sink->error()) << sink->error()->toString();
  EXPECT_EQ(sink->text(), "Hello!");
  ASSERT_EQ(d1.opens().size(), 1U);
  ASSERT_EQ(d2.opens().size(), 1U);
  EXPECT_EQ(d2.opens()[0].request_id, "cmpl-t1-retry1");
  EXPECT_EQ(p1.submits().size() + p2.submits().size(), 3U);  // two into d1, one into d2
  EXPECT_EQ(retries("prefill"), 1.0);
  EXPECT_EQ(retries("decode"), 1.0);
  // d1 was told to free its blocks.
  EXPECT_TRUE(waitFor([&] { return d1.live() == 0; }));
}

// When the KV can reach no decode worker, the request fails with the transfer's error once each
// has been tried (no endless retries), and every worker's blocks are freed.
TEST_F(PdBackendTest, NoDecodeWorkerTheKvCanReachFailsTheRequest) {
  for (auto* p : {&p1, &p2}) {
    p->addUnreachable(&d1);
    p->addUnreachable(&d2);
  }
  DecodeScript never;
  never.tokens = {{kHello}};
  d1.setScript(never);
  d2.setScript(never);
  startBackend();
  auto sink = std::make_shared<RecordingSink>();
  ASSERT_TRUE(backend->start(request(), sink).ok());
  ASSERT_TRUE(sink->waitEnd());
  ASSERT_TRUE(sink->error());
  EXPECT_EQ(sink->error()->code, ErrorCode::Timeout) << sink->error()->toString();
  EXPECT_EQ(d1.opens().size(), 1U);
  EXPECT_EQ(d2.opens().size(), 1U);
  EXPECT_TRUE(waitFor([&] { return d1.live() == 0 && d2.live() == 0; }));
}

// Decode-side prefix reuse: the prompt's token ids go in the open only to a decode worker whose
// status reports a prefix cache (docs/kv-memory.md); others get the open without them.
TEST_F(PdBackendTest, PromptTokenIdsGoOnlyToADecodeWorkerWithAPrefixCache) {
  DecodeScript script;
  script.tokens = {{kHello}, {kBang}};
  d1.setScript(script);
  startBackend();
  auto sink = std::make_shared<RecordingSink>();
  ASSERT_TRUE(backend->start(request(), sink).ok());
  ASSERT_TRUE(sink->waitEnd());
  ASSERT_FALSE(sink->error()) << sink->error()->toString();
  ASSERT_EQ(d1.opens().size(), 1U);
  EXPECT_TRUE(d1.opens()[0].prompt_token_ids.empty()) << "no prefix cache: no token ids";
  auto s = d1.status();
  s.prefix_cache_capacity = 64;
  ASSERT_TRUE(setD1Status(s, [](const auto& st) { return st.prefix_cache_capacity == 64; }));
  const auto sink2 = runToEnd(request("cmpl-t2"));
  ASSERT_FALSE(sink2->error()) << sink2->error()->toString();
  ASSERT_EQ(d1.opens().size(), 2U);
  EXPECT_EQ(d1.opens()[1].prompt_token_ids, (std::vector<TokenId>{0, static_cast<TokenId>(kHello)}));
  EXPECT_TRUE(d1.opens()[1].local_prompt_token_ids.empty());
}

// Conditional disaggregation: a prompt shorter than remote_prefill_min_tokens goes to the decode
// worker with its token ids and no prefill worker is asked; a prompt as long goes remote.
TEST_F(PdBackendTest, ShortPromptsArePrefilledByTheDecodeWorker) {
  startWithLocalPrefillBelow3Tokens();
  const auto sink = runToEnd(request());  // a 2-token prompt
  ASSERT_FALSE(sink->error()) << sink->error()->toString();
  EXPECT_EQ(sink->text(), "Hello!");
  ASSERT_EQ(d1.opens().size(), 1U);
  EXPECT_EQ(d1.opens()[0].local_prompt_token_ids, (std::vector<TokenId>{0, static_cast<TokenId>(kHello)}));
  EXPECT_EQ(d1.opens()[0].forced_first_token, -1);
  EXPECT_TRUE(p1.submits().empty());
  EXPECT_TRUE(p2.submits().empty());
  EXPECT_EQ(prefills("local", "short_prompt"), 1.0);

  GenerationRequest longer = request("cmpl-t2");
  longer.prompt_token_ids.push_back(static_cast<TokenId>(kBang));  // 3 tokens: not shorter than 3
  const auto sink2 = runToEnd(longer);
  ASSERT_FALSE(sink2->error()) << sink2->error()->toString();
  EXPECT_EQ(p1.submits().size() + p2.submits().size(), 1U);
  EXPECT_EQ(prefills("remote", "long_prompt"), 1.0);
}

// A short prompt is still prefilled remotely when the decode worker says it prefills no prompt
// that long (its status' local_prefill_max_tokens; 0 for a tensor-parallel worker): the router
// never sends what the worker would refuse.
TEST_F(PdBackendTest, AShortPromptGoesRemoteWhenTheDecodeWorkerPrefillsNoneThatLong) {
  startWithLocalPrefillBelow3Tokens();
  auto s = d1.status();
  s.local_prefill_max_tokens = 0;
  ASSERT_TRUE(setD1Status(s, [](const auto& st) { return st.local_prefill_max_tokens == 0; }));
  const auto sink = runToEnd(request());  // a 2-token prompt: short
  ASSERT_FALSE(sink->error()) << sink->error()->toString();
  EXPECT_EQ(sink->text(), "Hello!");
  ASSERT_EQ(d1.opens().size(), 1U);
  EXPECT_TRUE(d1.opens()[0].local_prompt_token_ids.empty());
  EXPECT_EQ(p1.submits().size() + p2.submits().size(), 1U);
  EXPECT_EQ(prefills("remote", "worker_limit"), 1.0);
  EXPECT_EQ(prefills("local", "short_prompt"), 0.0);

  // A limit of 2 tokens admits the 2-token prompt.
  s.local_prefill_max_tokens = 2;
  ASSERT_TRUE(setD1Status(s, [](const auto& st) { return st.local_prefill_max_tokens == 2; }));
  const auto sink2 = runToEnd(request("cmpl-t2"));
  ASSERT_FALSE(sink2->error()) << sink2->error()->toString();
  ASSERT_EQ(d1.opens().size(), 2U);
  EXPECT_EQ(d1.opens()[1].local_prompt_token_ids, (std::vector<TokenId>{0, static_cast<TokenId>(kHello)}));
  EXPECT_EQ(prefills("local", "short_prompt"), 1.0);
}

TEST_F(PdBackendTest, OverloadedPrefillIsRetriedAndExhaustedRetriesFailTheRequestAndFreeDecode) {
  p1.setBehaviour(PrefillBehaviour::Overloaded);
  p2.setBehaviour(PrefillBehaviour::Overloaded);
  PdBackendOptions o;
  o.prefill_retries = 1;
  o.decode_retries = 0;
  startBackend(o);
  auto sink = std::make_shared<RecordingSink>();
  ASSERT_TRUE(backend->start(request(), sink).ok());
  ASSERT_TRUE(sink->waitEnd());
  ASSERT_TRUE(sink->error());
  EXPECT_EQ(sink->error()->code, ErrorCode::Overloaded) << sink->error()->toString();
  EXPECT_EQ(p1.submits().size() + p2.submits().size(), 2U);
  EXPECT_EQ(retries("prefill"), 1.0);
  // D was told: it would otherwise wait for a second attempt.
  EXPECT_TRUE(waitFor([&] { return d1.live() == 0; }));
  EXPECT_TRUE(contains(d1.aborts(), "cmpl-t1") || contains(d1.gone(), "cmpl-t1"));
}

TEST_F(PdBackendTest, DecodeRefusalIsRetriedOnAnotherDecodeWorker) {
  DecodeScript refuse;
  refuse.refuse = ErrorCode::Overloaded;
  d1.setScript(refuse);
  DecodeScript ok;
  ok.tokens = {{kHello}};
  d2.setScript(ok);
  startBackend();
  auto sink = std::make_shared<RecordingSink>();
  ASSERT_TRUE(backend->start(request(), sink).ok());
  ASSERT_TRUE(sink->waitEnd());
  ASSERT_FALSE(sink->error()) << sink->error()->toString();
  EXPECT_EQ(sink->text(), "Hello");
  ASSERT_EQ(d1.opens().size(), 1U);
  ASSERT_EQ(d2.opens().size(), 1U);
  EXPECT_EQ(d2.opens()[0].request_id, "cmpl-t1-retry1");
  EXPECT_EQ(retries("decode"), 1.0);
}

// Every decode worker is full: the generation waits (backing off) until one has room, within its
// deadline, instead of failing.
TEST_F(PdBackendTest, FullDecodeWorkersAreWaitedForUntilOneHasRoom) {
  DecodeScript refuse;
  refuse.refuse = ErrorCode::Overloaded;
  d1.setScript(refuse);
  d2.setScript(refuse);
  startBackend();
  auto sink = std::make_shared<RecordingSink>();
  ASSERT_TRUE(backend->start(request(), sink).ok());
  ASSERT_TRUE(waitFor([&] { return d1.opens().size() + d2.opens().size() >= 4; }));  // retried, then waiting
  EXPECT_FALSE(sink->ended());
  DecodeScript ok;
  ok.tokens = {{kHello}};
  d1.setScript(ok);
  d2.setScript(ok);
  ASSERT_TRUE(sink->waitEnd());
  ASSERT_FALSE(sink->error()) << sink->error()->toString();
  EXPECT_EQ(sink->text(), "Hello");
  EXPECT_EQ(retries("decode"), 1.0);  // one retry elsewhere; the waits are not retries
}

TEST_F(PdBackendTest, AbortEndsAWaitForRoom) {
  DecodeScript refuse;
  refuse.refuse = ErrorCode::Overloaded;
  d1.setScript(refuse);
  d2.setScript(refuse);
  startBackend();
  auto sink = std::make_shared<RecordingSink>();
  auto control = backend->start(request(), sink);
  ASSERT_TRUE(control.ok());
  ASSERT_TRUE(waitFor([&] { return d1.opens().size() + d2.opens().size() >= 3; }));
  control.value()->abort();
  ASSERT_TRUE(sink->waitEnd());
  ASSERT_TRUE(sink->error());
  EXPECT_EQ(sink->error()->code, ErrorCode::Cancelled);
  EXPECT_TRUE(waitFor([&] { return backend->running() == 0; }));
}

TEST_F(PdBackendTest, RequestThatCanNeverFitIsNotRetried) {
  DecodeScript refuse;
  refuse.refuse = ErrorCode::ResourceExhausted;
  refuse.refuse_message = "request 17 needs 300 KV blocks (4800 tokens) but the pool has only 256";  // as D says
  d1.setScript(refuse);
  startBackend();
  auto sink = std::make_shared<RecordingSink>();
  ASSERT_TRUE(backend->start(request(), sink).ok());
  ASSERT_TRUE(sink->waitEnd());
  ASSERT_TRUE(sink->error());
  EXPECT_EQ(sink->error()->code, ErrorCode::ResourceExhausted);
  // Clients see this message (400): it must not name internal addresses.
  EXPECT_EQ(sink->error()->message.find("127.0.0.1"), std::string::npos) << sink->error()->message;
  // Nor the worker's transfer id or pool size: a clean public message instead.
  EXPECT_EQ(sink->error()->message, "the prompt needs more KV cache than a decode worker has; shorten the prompt");
  EXPECT_TRUE(d2.opens().empty());
  EXPECT_EQ(retries("decode"), 0.0);
}

TEST_F(PdBackendTest, DecodeCutBeforeAnyTokenIsRetriedElsewhere) {
  DecodeScript cut;
  cut.cut_after = 0;
  d1.setScript(cut);
  DecodeScript ok;
  ok.tokens = {{kWorld}};
  d2.setScript(ok);
  startBackend();
  auto sink = std::make_shared<RecordingSink>();
  ASSERT_TRUE(backend->start(request(), sink).ok());
  ASSERT_TRUE(sink->waitEnd());
  ASSERT_FALSE(sink->error()) << sink->error()->toString();
  EXPECT_EQ(sink->text(), " world");
  EXPECT_EQ(d2.opens().size(), 1U);
  EXPECT_EQ(retries("decode"), 1.0);
}

TEST_F(PdBackendTest, DecodeCutAfterATokenEndsWithAnErrorWithoutResumes) {
  DecodeScript cut;
  cut.tokens = {{kHello}, {kComma}, {kWorld}};
  cut.cut_after = 1;
  d1.setScript(cut);
  PdBackendOptions o;
  o.max_resumes = 0;
  startBackend(o);
  auto sink = std::make_shared<RecordingSink>();
  ASSERT_TRUE(backend->start(request(), sink).ok());
  ASSERT_TRUE(sink->waitEnd());
  EXPECT_EQ(sink->text(), "Hello");
  ASSERT_TRUE(sink->error());
  EXPECT_EQ(sink->error()->code, ErrorCode::PeerFailed) << sink->error()->toString();
  EXPECT_TRUE(d2.opens().empty());  // a token reached the client: no retry
  EXPECT_EQ(retries("decode"), 0.0);
}

// Resume (docs/kv-memory.md): the leg that lost its decode worker after a token reached the client
// continues on the other one. That token is the new leg's forced first token (the prompt alone is
// prefilled), which the new leg streams again and the router drops: the client's text has every
// token once.
TEST_F(PdBackendTest, DecodeCutAfterATokenIsResumedOnTheOtherWorker) {
  DecodeScript cut;
  cut.tokens = {{kHello}, {kComma}, {kWorld}};
  cut.cut_after = 1;
  d1.setScript(cut);
  DecodeScript rest;
  rest.tokens = {{kHello}, {kComma}, {kWorld, kBang}};
  d2.setScript(rest);
  startBackend();
  auto sink = std::make_shared<RecordingSink>();
  ASSERT_TRUE(backend->start(request(), sink).ok());
  ASSERT_TRUE(sink->waitEnd());
  ASSERT_FALSE(sink->error()) << sink->error()->toString();
  EXPECT_EQ(sink->text(), "Hello, world!");
  EXPECT_EQ(sink->ids(), (std::vector<TokenId>{kHello, kComma, kWorld, kBang}));
  ASSERT_EQ(d2.opens().size(), 1U);
  const worker_api::DecodeOpen open = d2.opens()[0];
  EXPECT_EQ(open.request_id, "cmpl-t1-resume1");
  EXPECT_EQ(open.prompt_tokens, 2);
  EXPECT_EQ(open.max_tokens, 16);
  EXPECT_TRUE(open.resumed_token_ids.empty());
  std::vector<worker_api::PrefillSubmit> submits = p1.submits();
  for (const auto& s : p2.submits()) submits.push_back(s);
  ASSERT_EQ(submits.size(), 2U);
  const auto& resumed = submits[0].request_id == "cmpl-t1-resume1" ? submits[0] : submits[1];
  EXPECT_EQ(resumed.request_id, "cmpl-t1-resume1");
  EXPECT_EQ(resumed.token_ids, (std::vector<TokenId>{0, kHello}));
  EXPECT_EQ(resumed.resumed_tokens, 0);
  EXPECT_EQ(resumed.forced_first_token, kHello);
  EXPECT_EQ(resumes("worker_lost"), 1.0);
  EXPECT_EQ(retries("decode"), 0.0);
}

// Preemption is flow control, not a failure: resumed even with no failure resumes allowed, and
// the next leg keeps the generation's arrival (so the worker does not pick it first again).
TEST_F(PdBackendTest, APreemptedRequestIsResumedOutsideTheFailureBudget) {
  DecodeScript preempt;
  preempt.tokens = {{kHello}, {kComma}, {kWorld}};
  preempt.preempt_after = 2;
  d1.setScript(preempt);
  DecodeScript rest;
  rest.tokens = {{kComma, kWorld}};  // the forced first token, then the next
  rest.finish_reason = FinishReason::Stop;
  d2.setScript(rest);
  PdBackendOptions o;
  o.max_resumes = 0;
  startBackend(o);
  auto sink = std::make_shared<RecordingSink>();
  ASSERT_TRUE(backend->start(request(), sink).ok());
  ASSERT_TRUE(sink->waitEnd());
  ASSERT_FALSE(sink->error()) << sink->error()->toString();
  EXPECT_EQ(sink->text(), "Hello, world");
  EXPECT_EQ(sink->reason(), FinishReason::Stop);
  ASSERT_EQ(d2.opens().size(), 1U);
  EXPECT_EQ(d2.opens()[0].resumed_token_ids, (std::vector<TokenId>{kHello}));
  EXPECT_EQ(d2.opens()[0].prompt_tokens, 3);
  EXPECT_EQ(d2.opens()[0].max_tokens, 15);
  ASSERT_EQ(d1.opens().size(), 1U);
  EXPECT_GT(d1.opens()[0].arrival_us, 0);
  EXPECT_EQ(d2.opens()[0].arrival_us, d1.opens()[0].arrival_us);
  EXPECT_EQ(resumes("preempted"), 1.0);
  EXPECT_EQ(resumes("worker_lost"), 0.0);
  EXPECT_TRUE(d1.aborts().empty()) << "a preempted request holds nothing to abort";
}

// Each worker loses the stream after one token: two resumes, then the error as without resume.
TEST_F(PdBackendTest, ResumesStopAtMaxResumes) {
  DecodeScript cut;
  cut.tokens = {{kHello}, {kComma}};
  cut.cut_after = 1;
  d1.setScript(cut);
  d2.setScript(cut);
  startBackend();
  auto sink = std::make_shared<RecordingSink>();
  ASSERT_TRUE(backend->start(request(), sink).ok());
  ASSERT_TRUE(sink->waitEnd());
  ASSERT_TRUE(sink->error());
  EXPECT_EQ(sink->error()->code, ErrorCode::PeerFailed) << sink->error()->toString();
  EXPECT_EQ(sink->ids(), (std::vector<TokenId>{kHello}));  // each resumed leg only repeats it
  EXPECT_EQ(d1.opens().size() + d2.opens().size(), 3U);
  EXPECT_EQ(resumes("worker_lost"), 2.0);
}

// A resumed leg that does not start with the token the client has is broken: no more resumes.
TEST_F(PdBackendTest, AResumedLegThatStartsWithAnotherTokenFails) {
  DecodeScript cut;
  cut.tokens = {{kHello}, {kComma}};
  cut.cut_after = 1;
  d1.setScript(cut);
  DecodeScript wrong;
  wrong.tokens = {{kWorld}, {kBang}};
  d2.setScript(wrong);
  startBackend();
  auto sink = std::make_shared<RecordingSink>();
  ASSERT_TRUE(backend->start(request(), sink).ok());
  ASSERT_TRUE(sink->waitEnd());
  ASSERT_TRUE(sink->error());
  EXPECT_EQ(sink->error()->code, ErrorCode::Corrupt) << sink->error()->toString();
  EXPECT_EQ(sink->ids(), (std::vector<TokenId>{kHello}));
  EXPECT_EQ(resumes("worker_lost"), 1.0);
}

TEST_F(PdBackendTest, AbortReachesBothWorkersAndEndsWithCancelled) {
  p1.setBehaviour(PrefillBehaviour::Hang);
  p2.setBehaviour(PrefillBehaviour::Hang);
  startBackend();
  auto sink = std::make_shared<RecordingSink>();
  auto control = backend->start(request(), sink);
  ASSERT_TRUE(control.ok());
  ASSERT_TRUE(waitFor([&] { return p1.submits().size() == 1; }));
  const auto t0 = std::chrono::steady_clock::now();
  control.value()->abort();
  control.value()->abort();  // idempotent
  ASSERT_TRUE(sink->waitEnd());
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s);
  ASSERT_TRUE(sink->error());
  EXPECT_EQ(sink->error()->code, ErrorCode::Cancelled);
  // Both legs were told (by the explicit calls; the closed connections say it too).
  EXPECT_TRUE(contains(p1.cancels(), "cmpl-t1")) << "prefill cancel missing";
  EXPECT_TRUE(contains(d1.aborts(), "cmpl-t1")) << "decode abort missing";
  EXPECT_TRUE(waitFor([&] { return d1.live() == 0; }));
  EXPECT_TRUE(p2.submits().empty());  // an abort is not a failure to retry
  EXPECT_TRUE(waitFor([&] { return backend->running() == 0; }));
}

TEST_F(PdBackendTest, AbortWhileTokensStreamReachesDecode) {
  DecodeScript slow;
  slow.tokens = {{kHello}, {kComma}};
  slow.hang_after = 1;
  d1.setScript(slow);
  startBackend();
  auto sink = std::make_shared<RecordingSink>();
  auto control = backend->start(request(), sink);
  ASSERT_TRUE(control.ok());
  ASSERT_TRUE(waitFor([&] { return sink->ids().size() == 1; }));
  control.value()->abort();
  ASSERT_TRUE(sink->waitEnd());
  ASSERT_TRUE(sink->error());
  EXPECT_EQ(sink->error()->code, ErrorCode::Cancelled);
  EXPECT_TRUE(waitFor([&] { return d1.live() == 0; }));
  EXPECT_TRUE(contains(d1.aborts(), "cmpl-t1") || contains(d1.gone(), "cmpl-t1"));
}

TEST_F(PdBackendTest, StalledDecodeStreamTimesOut) {
  DecodeScript stall;
  stall.tokens = {{kHello}, {kComma}};
  stall.hang_after = 1;
  d1.setScript(stall);
  PdBackendOptions o;
  o.stream_stall_timeout = 200ms;
  o.max_resumes = 0;
  startBackend(o);
  auto sink = std::make_shared<RecordingSink>();
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(backend->start(request(), sink).ok());
  ASSERT_TRUE(sink->waitEnd());
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_GE(took, 200ms);
  EXPECT_LT(took, 3s);
  EXPECT_EQ(sink->text(), "Hello");
  ASSERT_TRUE(sink->error());
  EXPECT_EQ(sink->error()->code, ErrorCode::Timeout) << sink->error()->toString();
  EXPECT_TRUE(waitFor([&] { return d1.live() == 0; }));
}

TEST_F(PdBackendTest, RequestDeadlineFiresWhilePrefillHangs) {
  p1.setBehaviour(PrefillBehaviour::Hang);
  p2.setBehaviour(PrefillBehaviour::Hang);
  PdBackendOptions o;
  o.decode_retries = 0;
  startBackend(o);
  auto sink = std::make_shared<RecordingSink>();
  auto req = request();
  req.deadline = std::chrono::steady_clock::now() + 300ms;
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(backend->start(req, sink).ok());
  ASSERT_TRUE(sink->waitEnd());
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 3s);
  ASSERT_TRUE(sink->error());
  EXPECT_EQ(sink->error()->code, ErrorCode::Timeout) << sink->error()->toString();
  // Both legs were ended at the workers.
  EXPECT_TRUE(waitFor([&] { return d1.live() == 0; }));
  EXPECT_TRUE(contains(p1.cancels(), "cmpl-t1") || contains(p1.gone(), "cmpl-t1"));
}

TEST_F(PdBackendTest, TheRequestsOwnDeadlineIsNotAWorkerFailure) {
  // Healthy workers, a slow stream and a short request_timeout_ms: the request times out, and
  // neither worker may leave rotation for it (once 1,338 of 1,500 such requests got 503).
  DecodeScript slow;
  slow.tokens = {{kHello}, {kComma}};
  slow.hang_after = 1;
  d1.setScript(slow);
  d2.setScript(slow);
  PdBackendOptions o;
  o.decode_retries = 0;
  startBackend(o, /*health_interval=*/60s, /*health_failures=*/1);
  for (int i = 0; i < 3; ++i) {
    auto sink = std::make_shared<RecordingSink>();
    auto req = request("cmpl-deadline" + std::to_string(i));
    req.deadline = std::chrono::steady_clock::now() + 200ms;
    ASSERT_TRUE(backend->start(req, sink).ok());
    ASSERT_TRUE(sink->waitEnd());
    ASSERT_TRUE(sink->error());
    EXPECT_EQ(sink->error()->code, ErrorCode::Timeout) << sink->error()->toString();
    EXPECT_EQ(registry->ready(WorkerRole::Decode).size(), 2U) << "a decode worker was blamed for the deadline";
    EXPECT_EQ(registry->ready(WorkerRole::Prefill).size(), 2U) << "a prefill worker was blamed for the deadline";
  }
  EXPECT_TRUE(waitFor([&] { return d1.live() == 0 && d2.live() == 0; }));
}

TEST_F(PdBackendTest, NoReadyWorkersIsOverloadedAndStartsNothing) {
  auto s = d1.status();
  s.draining = true;
  d1.setStatus(s);
  d2.setStatus(s);
  RegistryOptions ro;
  ro.decode_workers = {parseWorkerAddress(d1.address(), "t").value(), parseWorkerAddress(d2.address(), "t").value()};
  ro.prefill_workers = {parseWorkerAddress(p1.address(), "t").value()};
  ro.health_interval = 20ms;
  registry = WorkerRegistry::start(ro).value();
  ASSERT_TRUE(waitFor([&] { return registry->hasReady(WorkerRole::Prefill); }));
  backend = PdBackend::create({}, *registry, renderer().tokenizer(), metrics).value();
  EXPECT_FALSE(backend->ready());
  auto sink = std::make_shared<RecordingSink>();
  auto started = backend->start(request(), sink);
  ASSERT_FALSE(started.ok());
  EXPECT_EQ(started.error().code, ErrorCode::Overloaded);
  EXPECT_TRUE(d1.opens().empty());
  EXPECT_TRUE(d2.opens().empty());
}

TEST_F(PdBackendTest, BurstSpreadsOverDecodeWorkersBeforeTheNextPoll) {
  // Both decode workers look alike; without counting what it sent, every request of a burst
  // would go to the first one until the next poll.
  d2.setStatus(d1.status());
  DecodeScript script;
  script.tokens = {{kHello}};
  d1.setScript(script);
  d2.setScript(script);
  RegistryOptions ro;
  ro.decode_workers = {parseWorkerAddress(d1.address(), "t").value(), parseWorkerAddress(d2.address(), "t").value()};
  ro.prefill_workers = {parseWorkerAddress(p1.address(), "t").value()};
  ro.health_interval = 60000ms;  // one poll only: the counts of sent requests decide
  registry = WorkerRegistry::start(ro).value();
  ASSERT_TRUE(waitFor([&] { return registry->ready(WorkerRole::Decode).size() == 2; }));
  backend = PdBackend::create({}, *registry, renderer().tokenizer(), metrics).value();
  std::vector<std::shared_ptr<RecordingSink>> sinks;
  for (int i = 0; i < 6; ++i) {
    sinks.push_back(std::make_shared<RecordingSink>());
    auto req = request("cmpl-b" + std::to_string(i));
    req.max_tokens = 64;
    ASSERT_TRUE(backend->start(req, sinks.back()).ok());
    ASSERT_TRUE(sinks.back()->waitEnd());  // one after the other: the choice is deterministic
  }
  EXPECT_EQ(d1.opens().size(), 3U);
  EXPECT_EQ(d2.opens().size(), 3U);
}

// n = 3 (the ChoiceGroup): choice 0 opens its decode stream with choices = 3, the other choices
// attach to it on the same decode worker with their own seeds, and one prefill (choices = 3)
// serves all three; every choice's sink gets the whole stream.
TEST_F(PdBackendTest, ChoicesShareOneDecodeStreamAndOnePrefill) {
  startBackend();
  const auto sinks = recordingSinks(3);
  GenerationRequest g = request("cmpl-n3");
  g.seed = 9;
  auto control = backend->startChoices(g, {sinks.begin(), sinks.end()});
  ASSERT_TRUE(control.ok()) << control.error().toString();
  for (std::size_t i = 0; i < 3; ++i) {
    ASSERT_TRUE(sinks[i]->waitEnd()) << i;
    EXPECT_EQ(sinks[i]->reason(), FinishReason::Length) << i;
    EXPECT_EQ(sinks[i]->ids(), (std::vector<TokenId>{100, 101})) << i;
  }
  const auto submits = allSubmits();
  ASSERT_EQ(submits.size(), 1U) << "one prefill for every choice";
  EXPECT_EQ(submits[0].choices, 3);
  EXPECT_EQ(submits[0].sampling.seed, 9U);
  const auto opens = d1.opens();
  ASSERT_EQ(opens.size(), 3U);
  EXPECT_TRUE(d2.opens().empty());
  EXPECT_EQ(opens[0].choices, 3);
  EXPECT_TRUE(opens[0].attach_to.empty());
  std::set<std::int64_t> attached;
  for (std::size_t i = 1; i < 3; ++i) {
    EXPECT_EQ(opens[i].attach_to, "cmpl-n3");
    EXPECT_EQ(opens[i].choices, 1);
    EXPECT_EQ(opens[i].sampling.seed, pd::choiceSeed(9, opens[i].choice));
    attached.insert(opens[i].choice);
  }
  EXPECT_EQ(attached, (std::set<std::int64_t>{1, 2}));
  EXPECT_EQ(retries("decode"), 0);
}

// A choice that cannot attach (its parent stream is gone, say) is served alone: its own open with
// one choice and its own prefill, with its own seed; not counted as a retry.
TEST_F(PdBackendTest, AChoiceThatCannotAttachIsServedAlone) {
  d1.refuseAttach(ErrorCode::NotFound);
  d2.refuseAttach(ErrorCode::NotFound);
  startBackend();
  const auto sinks = recordingSinks(3);
  GenerationRequest g = request("cmpl-alone");
  g.seed = 4;
  auto control = backend->startChoices(g, {sinks.begin(), sinks.end()});
  ASSERT_TRUE(control.ok()) << control.error().toString();
  for (std::size_t i = 0; i < 3; ++i) {
    ASSERT_TRUE(sinks[i]->waitEnd()) << i;
    EXPECT_EQ(sinks[i]->ids(), (std::vector<TokenId>{100, 101})) << i;
  }
  const auto submits = allSubmits();
  ASSERT_EQ(submits.size(), 3U);
  std::multiset<std::int64_t> choices;
  std::set<std::uint64_t> seeds;
  for (const auto& s : submits) {
    choices.insert(s.choices);
    seeds.insert(s.sampling.seed);
  }
  EXPECT_EQ(choices, (std::multiset<std::int64_t>{1, 1, 3}));
  EXPECT_EQ(seeds, (std::set<std::uint64_t>{4, pd::choiceSeed(4, 1), pd::choiceSeed(4, 2)}));
  EXPECT_EQ(retries("decode"), 0);
}

// A decode worker that cannot share one prompt among choices (tensor parallelism refuses
// `choices` > 1 with Unsupported): every choice is served alone, as n = 1 with its own seed, and
// the request succeeds; not counted as a retry.
TEST_F(PdBackendTest, ChoicesAreServedAloneWhenTheDecodeWorkerCannotShare) {
  d1.refuseChoices(true);
  d2.refuseChoices(true);
  startBackend();
  const auto sinks = recordingSinks(3);
  GenerationRequest g = request("cmpl-tp");
  g.seed = 5;
  auto control = backend->startChoices(g, {sinks.begin(), sinks.end()});
  ASSERT_TRUE(control.ok()) << control.error().toString();
  for (std::size_t i = 0; i < 3; ++i) {
    ASSERT_TRUE(sinks[i]->waitEnd()) << i;
    ASSERT_FALSE(sinks[i]->error()) << i << ": " << sinks[i]->error()->toString();
    EXPECT_EQ(sinks[i]->ids(), (std::vector<TokenId>{100, 101})) << i;
  }
  const auto submits = allSubmits();
  ASSERT_EQ(submits.size(), 3U);
  std::set<std::uint64_t> seeds;
  for (const auto& s : submits) {
    EXPECT_EQ(s.choices, 1);
    seeds.insert(s.sampling.seed);
  }
  EXPECT_EQ(seeds, (std::set<std::uint64_t>{5, pd::choiceSeed(5, 1), pd::choiceSeed(5, 2)}));
  for (const auto* d : {&d1, &d2}) {
    for (const auto& o : d->opens()) EXPECT_TRUE(o.attach_to.empty()) << "no choice attaches";
  }
  EXPECT_EQ(retries("decode"), 0);
}

TEST_F(PdBackendTest, ServesTheOpenAiApiEndToEnd) {
  DecodeScript script;
  script.tokens = {{kHello}, {kComma}, {kWorld}, {kBang}};
  script.finish_reason = pd::FinishReason::Stop;
  d1.setScript(script);
  startBackend();
  ApiServerOptions ao;
  ao.served_model_name = "test-model";
  auto api = ApiServer::start(ao, *backend, renderer(), metrics);
  ASSERT_TRUE(api.ok()) << api.error().toString();
  http::Client client("127.0.0.1", api.value()->port());
  auto r = client.send({"POST",
                        "/v1/completions",
                        {{"Content-Type", "application/json"}},
                        R"({"model":"test-model","prompt":"Say hi","max_tokens":8,"return_token_ids":true})"},
                       10s);
  ASSERT_TRUE(r.ok()) << r.error().toString();
  ASSERT_EQ(r.value().status, 200) << r.value().body;
  const auto body = boost::json::parse(r.value().body).as_object();
  EXPECT_EQ(body.at("choices").as_array()[0].as_object().at("text").as_string(), "Hello, world!");
  EXPECT_EQ(body.at("usage").as_object().at("completion_tokens").as_int64(), 4);
  // The prompt went through the real tokenizer with its BOS.
  const auto ids = renderer().tokenize("Say hi").value();
  ASSERT_EQ(p1.submits().size(), 1U);
  EXPECT_EQ(p1.submits()[0].token_ids, std::vector<std::int32_t>(ids.begin(), ids.end()));
  EXPECT_EQ(d1.opens()[0].max_tokens, 8);

  // With every decode worker gone from rotation, the API answers 503.
  d1.setStatusFails(true);
  d2.setStatusFails(true);
  ASSERT_TRUE(waitFor([&] { return !backend->ready(); }));
  auto refused = client.send({"POST",
                              "/v1/completions",
                              {{"Content-Type", "application/json"}},
                              R"({"model":"test-model","prompt":"Say hi"})"},
                             10s);
  ASSERT_TRUE(refused.ok());
  EXPECT_EQ(refused.value().status, 503);
  api.value()->stop();
}

}  // namespace
}  // namespace pd::router
