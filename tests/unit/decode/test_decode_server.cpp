// The decode worker's internal API in one process over real HTTP (pd::http::Client) and real UCX:
// a DecodeServer on a golden model, and on the test's side a prefill worker made of the real
// parts (PrefillEngine + TransportKvSink on its own UcxTransport) fed by the descriptor the
// decode stream's first line carries. Checks the streamed greedy tokens against the golden ones
// (MTP off and on), every refusal, disconnect / abort / KV timeout freeing every block, a
// failed prefill attempt absorbed while the request keeps its blocks, and, with a cluster secret,
// records not signed with it failing their request with every block freed.
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <future>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "pd/common/http_client.h"
#include "pd/common/internal_auth.h"
#include "pd/common/worker_api.h"
#include "pd/decode/decode_server.h"
#include "pd/engine/engine.h"
#include "pd/kvtransfer/ucx_transport.h"
#include "pd/kvtransfer/wire.h"
#include "pd/prefill/prefill_engine.h"
#include "pd/prefill/transport_kv_sink.h"
#include "unit/decode/golden_support.h"

namespace pd::decode {
namespace {

namespace api = worker_api;
namespace kvt = kvtransfer;
using namespace std::chrono_literals;
using test_support::goldenDir;
using test_support::goldenIds;

constexpr auto kWait = 60s;
constexpr std::uint64_t kModelHash = 0x0123456789abcdefULL;
constexpr std::int64_t kBlocks = 16;
constexpr std::int64_t kHeadroom = 2;   // blocks an admission leaves free
constexpr std::int64_t kBlockSize = 8;  // 16 x 8 = 128 tokens: two golden requests (40 + 24 - 1 each)

std::unique_ptr<model::Engine> makeEngine(const std::string& model) {
  auto e = model::createCpuEngine(goldenDir() / model, model::CpuEngineOptions{1, std::nullopt, false});
  PD_CHECK_MSG(e.ok(), "cannot create the engine on the golden model");
  return std::move(e).value();
}

// The lines of one decode stream, read on a thread of its own (the test goes on meanwhile).
class StreamReader {
 public:
  // Stops reading (closing the connection) after `max_lines` lines; 0: read to the end. Signs the
  // call with `auth` when given.
  StreamReader(std::uint16_t port, std::string body, std::size_t max_lines = 0, const InternalAuth* auth = nullptr)
      : thread_([this, port, body = std::move(body), max_lines, auth] {
          http::Client client("127.0.0.1", port);
          http::ClientRequest req;
          req.method = "POST";
          req.target = std::string(api::kDecodeOpenPath);
          req.body = body;
          signRequest(auth, req.method, req.target, req.body, req.headers);
          std::size_t seen = 0;
          auto r = client.streamLines(req, kWait, [&](std::string_view line) {
            std::lock_guard lock(mutex_);
            lines_.emplace_back(line);
            cv_.notify_all();
            return max_lines == 0 || ++seen < max_lines;
          });
          std::lock_guard lock(mutex_);
          result_.emplace(std::move(r));
          cv_.notify_all();
        }) {}
  ~StreamReader() { thread_.join(); }
  StreamReader(const StreamReader&) = delete;
  StreamReader& operator=(const StreamReader&) = delete;
  StreamReader(StreamReader&&) = delete;
  StreamReader& operator=(StreamReader&&) = delete;

  // Line i as a DecodeEvent; nullopt when the stream ended (or timed out) before it.
  std::optional<api::DecodeEvent> event(std::size_t i) {
    std::unique_lock lock(mutex_);
    cv_.wait_for(lock, kWait, [&] { return lines_.size() > i || result_.has_value(); });
    if (lines_.size() <= i) return std::nullopt;
    auto e = api::parseDecodeEvent(lines_[i]);
    EXPECT_TRUE(e.ok()) << lines_[i];
    if (!e.ok()) return std::nullopt;
    return std::move(e).value();
  }
  // Waits for the end of the response.
  Result<http::ClientResponse> result() {
    std::unique_lock lock(mutex_);
    cv_.wait_for(lock, kWait, [&] { return result_.has_value(); });
    if (!result_) return makeError(ErrorCode::Timeout, "the stream did not end");
    return *result_;
  }
  std::vector<api::DecodeEvent> all() {
    (void)result();
    std::vector<api::DecodeEvent> out;
    std::lock_guard lock(mutex_);
    for (const auto& l : lines_) {
      auto e = api::parseDecodeEvent(l);
      EXPECT_TRUE(e.ok()) << l;
      if (e.ok()) out.push_back(std::move(e).value());
    }
    return out;
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<std::string> lines_;
  std::optional<Result<http::ClientResponse>> result_;
  std::thread thread_;  // last: started once the members above exist
};

// Tokens of a stream and its last event, checked to be exactly one finish/error at the end.
struct Outcome {
  std::vector<std::int32_t> tokens;
  api::DecodeEvent last;
};

Outcome collect(const std::vector<api::DecodeEvent>& events) {
  Outcome o;
  EXPECT_GE(events.size(), 2U);
  if (events.empty()) return o;
  EXPECT_EQ(events.front().type, api::DecodeEventType::Descriptor);
  for (std::size_t i = 1; i < events.size(); ++i) {
    const auto& e = events[i];
    if (i + 1 < events.size()) {
      EXPECT_EQ(e.type, api::DecodeEventType::Tokens) << "line " << i;
      o.tokens.insert(o.tokens.end(), e.token_ids.begin(), e.token_ids.end());
    }
  }
  o.last = events.back();
  EXPECT_TRUE(o.last.type == api::DecodeEventType::Finish || o.last.type == api::DecodeEventType::Error);
  return o;
}

class DecodeServerTest : public ::testing::TestWithParam<std::tuple<std::string, int>> {
 protected:
  void SetUp() override {
    const std::string model = std::get<0>(GetParam());
    const auto file = goldenDir() / model / "golden.safetensors";
    prompt_ = goldenIds(file, "p0.tokens");
    greedy_ = goldenIds(file, "p0.greedy");

    startServer(nullptr);
    prefill_model_ = makeEngine(model);
    setPrefillSecret(nullptr);
    auto p = prefill::PrefillEngine::create(*prefill_model_, {.chunk_size = 16, .cache_blocks = 16, .block_size = 8});
    ASSERT_TRUE(p.ok()) << p.error().toString();
    prefill_ = std::move(p).value();
    prefill_->start();
  }

  void TearDown() override {
    // Every test ends with the pool whole and nothing left expected by the transport.
    if (server_) {
      EXPECT_TRUE(server_->waitIdle(10s));
      const api::WorkerStatus s = status();
      EXPECT_EQ(s.free_blocks, kBlocks);
      EXPECT_EQ(s.running_requests, 0);
      EXPECT_EQ(s.queued_requests, 0);
      EXPECT_EQ(server_->transportStats().pending_receives, 0);
    }
    prefill_.reset();
    prefill_tx_.reset();
    server_.reset();
  }

  // (Re)starts the decode server; with `auth`, the test's calls are signed with it.
  void startServer(std::shared_ptr<InternalAuth> auth) {
    server_.reset();
    auth_ = auth;
    DecodeServerOptions o;
    o.decode.port = 0;
    o.decode.block_size = kBlockSize;
    o.decode.num_blocks = kBlocks;
    o.decode.kv_headroom_blocks = kHeadroom;
    o.decode.kv_dtype = "f32";  // exact KV: the golden greedy margins are as small as 0.01
    o.decode.num_speculative_tokens = std::get<1>(GetParam());
    o.decode.threads = 1;
    o.model_hash = kModelHash;
    o.auth = std::move(auth);
    auto s = DecodeServer::start(makeEngine(std::get<0>(GetParam())), o);
    ASSERT_TRUE(s.ok()) << s.error().toString();
    server_ = std::move(s).value();
  }

  // (Re)creates the test prefill's transport, signing its records with `auth` (null: unsigned).
  void setPrefillSecret(std::shared_ptr<const InternalAuth> auth) {
    prefill_tx_.reset();
    const ModelConfig& cfg = prefill_model_->config();
    kvt::CompatInfo compat;
    compat.model_hash = kModelHash;
    compat.kv_dtype = DType::F32;
    compat.block_size = kBlockSize;
    compat.num_layers = static_cast<std::uint32_t>(cfg.kvLayers());
    compat.kv_dim = static_cast<std::uint32_t>(cfg.latentDim());
    kvt::UcxTransportOptions tx;
    tx.compat = compat;
    tx.name = "test-prefill-kv";
    tx.auth = std::move(auth);
    auto t = kvt::createUcxTransport(tx);
    ASSERT_TRUE(t.ok()) << t.error().toString();
    prefill_tx_ = std::move(t).value();
  }

  // `prompt_tokens` 0: the test prompt's length.
  std::string openBody(const std::string& id, std::int64_t max_tokens, std::int64_t attempts = 1,
                       std::int64_t kv_timeout_ms = 60000, std::int64_t prompt_tokens = 0) const {
    api::DecodeOpen open;
    open.request_id = id;
    open.prompt_tokens = prompt_tokens > 0 ? prompt_tokens : static_cast<std::int64_t>(prompt_.size());
    open.max_tokens = max_tokens;
    open.ignore_eos = true;
    open.kv_timeout_ms = kv_timeout_ms;
    open.prefill_attempts = attempts;
    return api::toJson(open);
  }

  http::ClientResponse post(std::string_view path, std::string body) const {
    http::Client client("127.0.0.1", server_->port());
    http::ClientRequest req;
    req.method = "POST";
    req.target = std::string(path);
    req.body = std::move(body);
    signRequest(auth_.get(), req.method, req.target, req.body, req.headers);
    auto r = client.send(req, kWait);
    EXPECT_TRUE(r.ok()) << r.error().toString();
    return r.ok() ? std::move(r).value() : http::ClientResponse{};
  }

  http::ClientResponse get(std::string_view path) const {
    http::Client client("127.0.0.1", server_->port());
    http::ClientRequest req;
    req.target = std::string(path);
    signRequest(auth_.get(), req.method, req.target, req.body, req.headers);
    auto r = client.send(req, kWait);
    EXPECT_TRUE(r.ok()) << r.error().toString();
    return r.ok() ? std::move(r).value() : http::ClientResponse{};
  }

  api::WorkerStatus status() const {
    const http::ClientResponse r = get(api::kStatusPath);
    EXPECT_EQ(r.status, 200);
    auto s = api::parseWorkerStatus(r.body);
    EXPECT_TRUE(s.ok()) << r.body;
    return s.ok() ? *s : api::WorkerStatus{};
  }

  static kvt::KvDescriptor descriptorOf(const api::DecodeEvent& first) {
    EXPECT_EQ(first.type, api::DecodeEventType::Descriptor);
    const auto* bytes = reinterpret_cast<const std::uint8_t*>(first.kv_descriptor.data());
    auto d = kvt::decodeKvDescriptor(std::span<const std::uint8_t>(bytes, first.kv_descriptor.size()));
    PD_CHECK_MSG(d.ok(), "the descriptor line does not decode");
    return std::move(d).value();
  }

  // One prefill attempt into the descriptor's blocks through the real engine and transport;
  // the future gets the transport's verdict on the transfer.
  std::future<Status> prefillInto(const kvt::KvDescriptor& d) {
    auto done = std::make_shared<std::promise<Status>>();
    auto future = done->get_future();
    auto sink =
        prefill::TransportKvSink::create(*prefill_tx_, d, kvt::Clock::now() + kWait,
                                         [done](const kvt::TransferId&, Status s) { done->set_value(std::move(s)); });
    EXPECT_TRUE(sink.ok()) << sink.error().toString();
    if (!sink.ok()) {
      done->set_value(sink.error());
      return future;
    }
    prefill::PrefillRequest r;
    r.id = d.transfer_id.lo;  // any id unique in the prefill engine
    r.tokens = prompt_;
    r.sink = std::move(sink).value();
    const Status s = prefill_->submit(std::move(r));
    EXPECT_TRUE(s.ok()) << s.error().toString();
    return future;
  }

  // A prefill attempt that fails: the prefill side sends a failure record for the descriptor.
  void failedPrefill(const kvt::KvDescriptor& d) {
    std::promise<Status> done;
    auto future = done.get_future();
    auto sink =
        prefill::TransportKvSink::create(*prefill_tx_, d, kvt::Clock::now() + kWait,
                                         [&done](const kvt::TransferId&, Status s) { done.set_value(std::move(s)); });
    ASSERT_TRUE(sink.ok()) << sink.error().toString();
    (*sink)->fail(makeError(ErrorCode::Internal, "injected prefill failure"));
    ASSERT_EQ(future.wait_for(kWait), std::future_status::ready);
    EXPECT_EQ(future.get().error().code, ErrorCode::Cancelled);  // the transport's answer to an abort
  }

  std::vector<std::int32_t> prompt_;
  std::vector<std::int32_t> greedy_;
  std::shared_ptr<InternalAuth> auth_;  // signs the test's calls when the server has a secret
  std::unique_ptr<DecodeServer> server_;
  std::unique_ptr<model::Engine> prefill_model_;
  std::unique_ptr<kvt::Transport> prefill_tx_;
  std::unique_ptr<prefill::PrefillEngine> prefill_;
};

TEST_P(DecodeServerTest, StreamsTheGoldenGreedyTokens) {
  StreamReader stream(server_->port(), openBody("cmpl-golden", static_cast<std::int64_t>(greedy_.size())));
  auto first = stream.event(0);
  ASSERT_TRUE(first.has_value());
  const kvt::KvDescriptor d = descriptorOf(*first);
  EXPECT_EQ(first->blocks, static_cast<std::int64_t>(d.block_ids.size()));
  EXPECT_EQ(d.num_tokens, prompt_.size());
  EXPECT_TRUE(kvt::validateDescriptor(d).ok());
  auto sent = prefillInto(d);
  ASSERT_EQ(sent.wait_for(kWait), std::future_status::ready);
  const Status s = sent.get();
  EXPECT_TRUE(s.ok()) << s.error().toString();

  auto response = stream.result();
  ASSERT_TRUE(response.ok()) << response.error().toString();
  EXPECT_EQ(response->status, 200);
  EXPECT_EQ(response->header("Content-Type"), "application/x-ndjson");
  const Outcome o = collect(stream.all());
  EXPECT_EQ(o.tokens, greedy_);
  EXPECT_EQ(o.last.type, api::DecodeEventType::Finish);
  EXPECT_EQ(o.last.finish_reason, pd::FinishReason::Length);
  EXPECT_EQ(o.last.prompt_tokens, static_cast<std::int64_t>(prompt_.size()));
  EXPECT_EQ(o.last.completion_tokens, static_cast<std::int64_t>(greedy_.size()));

  const std::string metrics = get("/metrics").body;
  EXPECT_NE(metrics.find("pdserve_decode_requests_total{outcome=\"length\"} 1"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("pdserve_kv_blocks_total 16"), std::string::npos);
  EXPECT_NE(metrics.find("pdserve_decode_generated_tokens_total 23"), std::string::npos);
  EXPECT_NE(metrics.find("pdserve_kv_transfers_succeeded_total{side=\"receive\"} 1"), std::string::npos);
  if (std::get<1>(GetParam()) > 0) {
    EXPECT_EQ(metrics.find("pdserve_decode_mtp_drafts_proposed_total 0\n"), std::string::npos) << "MTP never drafted";
  }
}

TEST_P(DecodeServerTest, RefusalsComeAsErrorStatusesWithTheirCodes) {
  // Malformed JSON and a bad field.
  http::ClientResponse r = post(api::kDecodeOpenPath, "{not json");
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(api::parseErrorJson(r.status, r.body).code, ErrorCode::InvalidArgument) << r.body;
  r = post(api::kDecodeOpenPath, R"({"request_id":"x","prompt_tokens":0,"max_tokens":4})");
  EXPECT_EQ(r.status, 400);
  // Can never fit: a 129-token prompt needs 17 blocks of a 16-block pool. (A long max_tokens is
  // no reason to refuse: blocks come as tokens do.)
  r = post(api::kDecodeOpenPath, openBody("cmpl-huge", 1, 1, 60000, kBlocks * kBlockSize + 1));
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(api::parseErrorJson(r.status, r.body).code, ErrorCode::ResourceExhausted) << r.body;

  // Two 40-token prompts take 5 blocks each; a third would leave fewer than the headroom's 2
  // blocks free: Overloaded (retryable). An id already held is refused.
  StreamReader a(server_->port(), openBody("cmpl-a", 24));
  StreamReader b(server_->port(), openBody("cmpl-b", 200));  // its whole reservation would not fit
  ASSERT_TRUE(a.event(0).has_value());
  ASSERT_TRUE(b.event(0).has_value());
  EXPECT_EQ(status().free_blocks, kBlocks - 2 * 5);  // 40-token prompts: 5 blocks allocated each
  EXPECT_EQ(status().queued_requests, 2);
  r = post(api::kDecodeOpenPath, openBody("cmpl-c", 24));
  EXPECT_EQ(r.status, 503);
  EXPECT_EQ(api::parseErrorJson(r.status, r.body).code, ErrorCode::Overloaded) << r.body;
  r = post(api::kDecodeOpenPath, openBody("cmpl-a", 1));
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(api::parseErrorJson(r.status, r.body).code, ErrorCode::InvalidArgument) << r.body;

  // Draining refuses new streams with 503 and /ready says so; open streams go on.
  server_->beginDrain();
  EXPECT_EQ(get("/ready").status, 503);
  EXPECT_EQ(get("/health").status, 200);
  r = post(api::kDecodeOpenPath, openBody("cmpl-d", 1));
  EXPECT_EQ(r.status, 503);
  EXPECT_EQ(api::parseErrorJson(r.status, r.body).code, ErrorCode::Overloaded);
  EXPECT_TRUE(status().draining);

  for (const char* id : {"cmpl-a", "cmpl-b"}) {
    r = post(api::kDecodeAbortPath, std::string(R"({"request_id":")") + id + "\"}");
    EXPECT_EQ(r.status, 200);
    EXPECT_EQ(r.body, R"({"found":true})");
  }
  for (StreamReader* s : {&a, &b}) {
    const Outcome o = collect(s->all());
    EXPECT_EQ(o.last.type, api::DecodeEventType::Error);
    EXPECT_EQ(o.last.code, ErrorCode::Cancelled);
  }
  r = post(api::kDecodeAbortPath, R"({"request_id":"cmpl-a"})");
  EXPECT_EQ(r.body, R"({"found":false})");
  const std::string metrics = get("/metrics").body;
  EXPECT_NE(metrics.find("pdserve_decode_refused_total{code=\"Overloaded\"} 2"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("pdserve_decode_refused_total{code=\"ResourceExhausted\"} 1"), std::string::npos);
  EXPECT_NE(metrics.find("pdserve_decode_requests_total{outcome=\"aborted\"} 2"), std::string::npos);
}

// /ready is 503 exactly while a minimal request (1 prompt token, max_tokens 1: one block) cannot
// be admitted, and 200 again once a block is free; the router's status poll sees the same.
TEST_P(DecodeServerTest, ReadyFollowsWhetherAMinimalRequestFits) {
  const auto readyUntil = [&](int want) {
    const auto until = std::chrono::steady_clock::now() + kWait;
    http::ClientResponse r = get("/ready");
    while (r.status != want && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(5ms);
      r = get("/ready");
    }
    return r;
  };
  const auto minimalOpen = [](const std::string& id) {
    api::DecodeOpen open;
    open.request_id = id;
    open.prompt_tokens = 1;
    open.max_tokens = 1;
    open.kv_timeout_ms = 60000;
    return api::toJson(open);
  };
  EXPECT_EQ(get("/ready").status, 200);

  // Two 40-token prompts take 5 blocks each and a 24-token one 3: 3 are free, 1 beyond the
  // headroom.
  StreamReader a(server_->port(), openBody("cmpl-a", 24));
  StreamReader b(server_->port(), openBody("cmpl-b", 16));
  StreamReader c(server_->port(), openBody("cmpl-c", 16, 1, 60000, 24));
  ASSERT_TRUE(a.event(0).has_value());
  ASSERT_TRUE(b.event(0).has_value());
  ASSERT_TRUE(c.event(0).has_value());
  EXPECT_EQ(status().free_blocks, kHeadroom + 1);
  EXPECT_EQ(get("/ready").status, 200) << "one available block admits a minimal request";
  EXPECT_TRUE(status().ready);

  // The minimal request takes that block: now nothing more fits.
  StreamReader m(server_->port(), minimalOpen("cmpl-min"));
  ASSERT_TRUE(m.event(0).has_value());
  const http::ClientResponse full = readyUntil(503);
  EXPECT_EQ(full.status, 503);
  EXPECT_NE(full.body.find("KV pool full: 0 of 16 blocks available"), std::string::npos) << full.body;
  EXPECT_EQ(get("/health").status, 200) << "a full worker is healthy";
  const api::WorkerStatus st = status();
  EXPECT_FALSE(st.ready);
  EXPECT_FALSE(st.draining);
  http::ClientResponse r = post(api::kDecodeOpenPath, minimalOpen("cmpl-min2"));
  EXPECT_EQ(r.status, 503) << "the refusal /ready announced";
  EXPECT_EQ(api::parseErrorJson(r.status, r.body).code, ErrorCode::Overloaded) << r.body;

  // Aborting the minimal request frees its block: ready again; then the others.
  r = post(api::kDecodeAbortPath, R"({"request_id":"cmpl-min"})");
  EXPECT_EQ(r.body, R"({"found":true})");
  EXPECT_EQ(collect(m.all()).last.code, ErrorCode::Cancelled);
  const http::ClientResponse again = readyUntil(200);
  EXPECT_EQ(again.status, 200) << again.body;
  EXPECT_EQ(again.body, "ready");
  EXPECT_TRUE(status().ready);
  for (const char* id : {"cmpl-a", "cmpl-b", "cmpl-c"}) {
    r = post(api::kDecodeAbortPath, std::string(R"({"request_id":")") + id + "\"}");
    EXPECT_EQ(r.body, R"({"found":true})");
  }
  for (StreamReader* s : {&a, &b, &c}) EXPECT_EQ(collect(s->all()).last.code, ErrorCode::Cancelled);
  EXPECT_EQ(get("/ready").status, 200);
}

TEST_P(DecodeServerTest, ClientDisconnectFreesTheBlocks) {
  // While waiting for KV: the stream's connection closes after the descriptor line.
  {
    StreamReader s(server_->port(), openBody("cmpl-gone", 24), /*max_lines=*/1);
    ASSERT_TRUE(s.event(0).has_value());
    ASSERT_TRUE(s.result().ok());
  }
  ASSERT_TRUE(server_->waitIdle(10s));
  EXPECT_EQ(status().free_blocks, kBlocks);
  EXPECT_EQ(server_->transportStats().pending_receives, 0) << "the KV expectation outlived its request";
  EXPECT_NE(get("/metrics").body.find("pdserve_decode_requests_total{outcome=\"aborted\"} 1"), std::string::npos);

  // Mid-stream: tokens are flowing when the client goes away.
  {
    StreamReader s(server_->port(), openBody("cmpl-gone-later", 60), /*max_lines=*/2);
    auto first = s.event(0);
    ASSERT_TRUE(first.has_value());
    auto sent = prefillInto(descriptorOf(*first));
    ASSERT_TRUE(s.event(1).has_value());
    ASSERT_TRUE(s.result().ok());
    ASSERT_EQ(sent.wait_for(kWait), std::future_status::ready);
  }
  ASSERT_TRUE(server_->waitIdle(10s));
  EXPECT_EQ(status().free_blocks, kBlocks);
}

TEST_P(DecodeServerTest, KvTimeoutEndsTheStreamWithAnErrorAndFreesTheBlocks) {
  StreamReader s(server_->port(), openBody("cmpl-late", 24, 1, /*kv_timeout_ms=*/300));
  ASSERT_TRUE(s.event(0).has_value());
  const Outcome o = collect(s.all());
  EXPECT_TRUE(o.tokens.empty());
  EXPECT_EQ(o.last.type, api::DecodeEventType::Error);
  EXPECT_EQ(o.last.code, ErrorCode::Timeout) << o.last.message;
  EXPECT_EQ(status().free_blocks, kBlocks);
  EXPECT_NE(get("/metrics").body.find("pdserve_decode_requests_total{outcome=\"timeout\"} 1"), std::string::npos);
}

TEST_P(DecodeServerTest, AFailedPrefillAttemptIsAbsorbedAndTheNextOneDecodes) {
  StreamReader s(server_->port(), openBody("cmpl-retry", static_cast<std::int64_t>(greedy_.size()), /*attempts=*/2));
  auto first = s.event(0);
  ASSERT_TRUE(first.has_value());
  const kvt::KvDescriptor d = descriptorOf(*first);
  failedPrefill(d);
  // The request kept its blocks and waits for the next attempt on the same descriptor.
  const api::WorkerStatus mid = status();
  EXPECT_EQ(mid.queued_requests, 1);
  EXPECT_EQ(mid.free_blocks, kBlocks - static_cast<std::int64_t>(d.block_ids.size()));
  auto sent = prefillInto(d);
  ASSERT_EQ(sent.wait_for(kWait), std::future_status::ready);
  EXPECT_TRUE(sent.get().ok());
  const Outcome o = collect(s.all());
  EXPECT_EQ(o.tokens, greedy_);
  EXPECT_EQ(o.last.type, api::DecodeEventType::Finish);
  EXPECT_NE(get("/metrics").body.find("pdserve_decode_prefill_retries_total 1"), std::string::npos);
}

TEST_P(DecodeServerTest, TheLastPrefillAttemptsFailureEndsTheStream) {
  StreamReader s(server_->port(), openBody("cmpl-fail", 24, /*attempts=*/1));
  auto first = s.event(0);
  ASSERT_TRUE(first.has_value());
  failedPrefill(descriptorOf(*first));
  const Outcome o = collect(s.all());
  EXPECT_EQ(o.last.type, api::DecodeEventType::Error);
  EXPECT_EQ(o.last.code, ErrorCode::Internal);  // the prefill side's code, passed through
  EXPECT_NE(o.last.message.find("injected prefill failure"), std::string::npos) << o.last.message;
  EXPECT_NE(get("/metrics").body.find("pdserve_decode_requests_total{outcome=\"kv_failed\"} 1"), std::string::npos);
}

// Transfer ids are 128 bits drawn from the CSPRNG, not counted: one request's id says nothing about
// the next one's, in either half.
TEST_P(DecodeServerTest, TransferIdsAreRandomNotCounted) {
  std::vector<kvt::KvDescriptor> seen;
  for (int i = 0; i < 6; ++i) {
    const std::string id = "cmpl-id-" + std::to_string(i);
    StreamReader s(server_->port(), openBody(id, 24));
    auto first = s.event(0);
    ASSERT_TRUE(first.has_value());
    seen.push_back(descriptorOf(*first));
    EXPECT_EQ(post(api::kDecodeAbortPath, R"({"request_id":")" + id + "\"}").body, R"({"found":true})");
    EXPECT_EQ(collect(s.all()).last.code, ErrorCode::Cancelled);
  }
  for (std::size_t i = 0; i < seen.size(); ++i) {
    EXPECT_FALSE(seen[i].transfer_id.empty());
    for (std::size_t j = 0; j < i; ++j) {
      for (const auto half : {&kvt::TransferId::hi, &kvt::TransferId::lo}) {
        const std::uint64_t a = seen[i].transfer_id.*half, b = seen[j].transfer_id.*half;
        EXPECT_GT(a > b ? a - b : b - a, 1U << 20)
            << "ids " << seen[j].transfer_id.hex() << " then " << seen[i].transfer_id.hex() << " look counted";
      }
    }
  }
}

std::shared_ptr<InternalAuth> clusterSecret(char fill) {
  auto auth =
      InternalAuth::create({std::vector<std::uint8_t>(kMinClusterSecretBytes, static_cast<std::uint8_t>(fill))});
  PD_CHECK(auth.ok());
  return std::move(auth).value();
}

// A decode worker with a cluster secret takes only completion records signed with it: a prefill
// side that holds the descriptor (and so its transfer key) but not the secret, or another
// secret, fails the request at once with Unauthenticated, every block is freed and the refusal
// is counted; the worker goes on serving, and a correctly signed transfer decodes.
TEST_P(DecodeServerTest, RecordsNotSignedWithTheClusterSecretFailTheRequestAndFreeItsBlocks) {
  startServer(clusterSecret('a'));
  struct Case {
    std::shared_ptr<const InternalAuth> prefill_secret;
    std::string id;
    bool accepted;
  };
  const std::vector<Case> cases = {{nullptr, "cmpl-unsigned", false},
                                   {clusterSecret('b'), "cmpl-other-secret", false},
                                   {auth_, "cmpl-signed", true}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.id);
    setPrefillSecret(c.prefill_secret);
    StreamReader stream(server_->port(), openBody(c.id, static_cast<std::int64_t>(greedy_.size()), /*attempts=*/2), 0,
                        auth_.get());
    auto first = stream.event(0);
    ASSERT_TRUE(first.has_value());
    auto sent = prefillInto(descriptorOf(*first));
    ASSERT_EQ(sent.wait_for(kWait), std::future_status::ready);
    EXPECT_TRUE(sent.get().ok()) << "the record was delivered; the receiver judged it";
    const Outcome o = collect(stream.all());
    if (c.accepted) {
      EXPECT_EQ(o.tokens, greedy_);
      EXPECT_EQ(o.last.type, api::DecodeEventType::Finish);
    } else {
      EXPECT_TRUE(o.tokens.empty());
      EXPECT_EQ(o.last.type, api::DecodeEventType::Error);
      EXPECT_EQ(o.last.code, ErrorCode::Unauthenticated) << o.last.message;
    }
    ASSERT_TRUE(server_->waitIdle(10s));
    EXPECT_EQ(status().free_blocks, kBlocks);
  }
  const std::string metrics = get("/metrics").body;
  EXPECT_NE(metrics.find("pdserve_kv_records_total{event=\"unauthenticated\"} 2"), std::string::npos) << metrics;
  EXPECT_EQ(get("/health").status, 200);
}

// A worker started without a tokenizer vocabulary (options.grammars null) cannot honour an output
// constraint: it refuses the open with Unsupported (a 400) instead of decoding unconstrained text.
TEST_P(DecodeServerTest, AConstraintIsRefusedWithoutAVocabulary) {
  auto open = api::parseDecodeOpen(openBody("cmpl-json", 4));
  ASSERT_TRUE(open.ok());
  open->ignore_eos = false;
  open->constraint = R"({"kind":"json_object"})";
  const http::ClientResponse r = post(api::kDecodeOpenPath, api::toJson(*open));
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(api::parseErrorJson(r.status, r.body).code, ErrorCode::Unsupported) << r.body;
  EXPECT_EQ(status().queued_requests, 0);
  EXPECT_EQ(status().free_blocks, kBlocks);
}

INSTANTIATE_TEST_SUITE_P(Golden, DecodeServerTest,
                         ::testing::Combine(::testing::Values("tiny-bf16", "tiny-fp8"), ::testing::Values(0, 1)),
                         [](const auto& param_info) {
                           std::string name =
                               std::get<0>(param_info.param) + "_mtp" + std::to_string(std::get<1>(param_info.param));
                           for (char& c : name) {
                             if (c == '-') c = '_';
                           }
                           return name;
                         });

}  // namespace
}  // namespace pd::decode
