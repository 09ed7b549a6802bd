// The prefill worker's serving core in one process over real HTTP and real UCX: /ready follows the
// engine's queue. The model engine is held at a gate (tests/fakes/gated_engine.h), so the queue is
// full by construction: one prompt computing (held), one queued, and the next submission refused.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "fakes/gated_engine.h"
#include "integration/prefill_worker_util.h"
#include "pd/common/http_client.h"
#include "pd/common/worker_api.h"
#include "pd/engine/engine.h"
#include "pd/engine/model_hash.h"
#include "pd/prefill/prefill_server.h"

namespace pd::prefill {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using testsupport::DecodeSide;
using testsupport::submitJson;

constexpr auto kWait = 60s;

http::ClientResponse send(std::uint16_t port, const std::string& method, std::string_view path, std::string body = {}) {
  http::Client client("127.0.0.1", port);
  http::ClientRequest r;
  r.method = method;
  r.target = std::string(path);
  r.body = std::move(body);
  auto answer = client.send(r, kWait);
  EXPECT_TRUE(answer.ok()) << answer.error().toString();
  return answer.ok() ? std::move(answer).value() : http::ClientResponse{};
}

// Polls GET /ready until it answers `status`; the last answer (its status may differ at the deadline).
http::ClientResponse readyUntil(std::uint16_t port, int status) {
  const auto until = Clock::now() + kWait;
  http::ClientResponse r = send(port, "GET", "/ready");
  while (r.status != status && Clock::now() < until) {
    std::this_thread::sleep_for(5ms);
    r = send(port, "GET", "/ready");
  }
  return r;
}

TEST(PrefillServerReady, ReadyIs503WhileTheQueueIsFullAnd200OnceItDrains) {
  const std::filesystem::path model_dir = std::filesystem::path(PD_TEST_DATA_DIR) / "golden" / "tiny-bf16";
  auto side = DecodeSide::create(model_dir, 64, 16, DType::F32);
  ASSERT_TRUE(side.ok()) << side.error().toString();
  auto engine = model::createCpuEngine(model_dir, model::CpuEngineOptions{1, std::nullopt, false});
  ASSERT_TRUE(engine.ok()) << engine.error().toString();
  auto gated = std::make_unique<fakes::GatedEngine>(std::move(engine).value());
  fakes::GatedEngine& gate = *gated;
  auto hash = modelHash(model_dir);
  ASSERT_TRUE(hash.ok());

  PrefillServerOptions o;
  o.prefill.max_queued_requests = 1;
  o.prefill.io_threads = 2;
  o.kvtransfer.ucx_tls = "tcp";
  o.model_hash = *hash;
  auto started = PrefillServer::start(std::move(gated), o);
  ASSERT_TRUE(started.ok()) << started.error().toString();
  std::unique_ptr<PrefillServer> server = std::move(started).value();
  const std::uint16_t port = server->port();
  EXPECT_EQ(send(port, "GET", "/ready").status, 200);

  const std::vector<std::int32_t> prompt{5, 6, 7, 8, 9};
  const auto n = static_cast<std::uint32_t>(prompt.size());
  const auto submit = [&](std::uint64_t id, const std::string& name) {
    const kvtransfer::KvDescriptor d = (*side)->expect(id, n, {static_cast<std::uint32_t>(id)}, 30s);
    return send(port, "POST", worker_api::kPrefillPath, submitJson(name, prompt, d, 30000));
  };

  // A computes (held at the gate): the queue is empty again, so the worker still takes work.
  std::optional<http::ClientResponse> a;
  std::thread first([&] { a = submit(1, "cmpl-a"); });
  ASSERT_TRUE(gate.waitEntered(1, kWait));
  EXPECT_EQ(send(port, "GET", "/ready").status, 200);

  // B waits in the queue, which is now full: /ready says so, the status says not ready, and the
  // next submission is refused as /ready announced.
  std::optional<http::ClientResponse> b;
  std::thread second([&] { b = submit(2, "cmpl-b"); });
  const http::ClientResponse full = readyUntil(port, 503);
  EXPECT_EQ(full.status, 503);
  EXPECT_NE(full.body.find("prefill queue full: 1 of 1"), std::string::npos) << full.body;
  EXPECT_EQ(send(port, "GET", "/health").status, 200) << "a full worker is healthy";
  auto st = worker_api::parseWorkerStatus(send(port, "GET", worker_api::kStatusPath).body);
  ASSERT_TRUE(st.ok());
  EXPECT_FALSE(st->ready);
  EXPECT_FALSE(st->draining);
  EXPECT_EQ(st->queued_requests, 1);
  const http::ClientResponse refused = submit(3, "cmpl-c");
  EXPECT_EQ(refused.status, 503) << refused.body;
  EXPECT_EQ(worker_api::parseErrorJson(refused.status, refused.body).code, ErrorCode::Overloaded);

  // Open the gate: A and B compute and deliver, the queue empties and /ready is 200 again.
  gate.open();
  first.join();
  second.join();
  ASSERT_TRUE(a.has_value() && b.has_value());
  EXPECT_EQ(a->status, 200) << a->body;
  EXPECT_EQ(b->status, 200) << b->body;
  const http::ClientResponse again = readyUntil(port, 200);
  EXPECT_EQ(again.status, 200) << again.body;
  EXPECT_EQ(again.body, "ready");
  (void)(*side)->transport().cancelExpect(3);  // C's expectation, if its refusal sent no record
  server->stop();
}

}  // namespace
}  // namespace pd::prefill
