// `pdserve decode` as a process (tools/pdserve/cmd_decode.cpp) on a golden model: --check-config,
// the PDSERVE_READY line, /health /ready /metrics /v1/internal/status over real HTTP, and a
// SIGTERM drain with a stream still open: /ready turns 503 at once, new streams are refused with
// 503 Overloaded, the open stream ends with an error line when decode.drain_timeout_ms is over,
// and the process exits 0.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "pd/common/http_client.h"
#include "pd/common/subprocess.h"
#include "pd/common/worker_api.h"

namespace pd {
namespace {

namespace api = worker_api;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

const std::string kModel = std::string(PD_TEST_DATA_DIR) + "/golden/tiny-bf16";
constexpr auto kDrain = 1500ms;

std::unique_ptr<proc::Subprocess> spawnDecode(std::vector<std::string> extra, bool capture_stderr) {
  proc::SpawnOptions o;
  o.argv = {PD_PDSERVE_BIN, "decode", "--model.path", kModel};
  o.argv.insert(o.argv.end(), extra.begin(), extra.end());
  o.capture_stderr = capture_stderr;
  auto p = proc::Subprocess::spawn(o);
  PD_CHECK_MSG(p.ok(), "cannot spawn pdserve");
  return std::move(p).value();
}

http::ClientResponse send(std::uint16_t port, std::string method, std::string target, std::string body = {}) {
  http::Client client("127.0.0.1", port);
  http::ClientRequest req;
  req.method = std::move(method);
  req.target = std::move(target);
  req.body = std::move(body);
  auto r = client.send(req, 10s);
  EXPECT_TRUE(r.ok()) << r.error().toString();
  return r.ok() ? std::move(r).value() : http::ClientResponse{};
}

std::string openBody(const std::string& id) {
  api::DecodeOpen open;
  open.request_id = id;
  open.prompt_tokens = 40;
  open.max_tokens = 8;
  open.kv_timeout_ms = 60000;
  return api::toJson(open);
}

TEST(DecodeWorkerProcess, CheckConfigValidatesWithoutServing) {
  auto ok = spawnDecode({"--check-config", "--decode.num_blocks", "32"}, true);
  proc::LineReader out(ok->stdoutFd());
  EXPECT_EQ(ok->wait(30s), std::optional<int>(0));
  EXPECT_EQ(out.next(1s), std::nullopt) << "--check-config printed something";

  // Tensor parallelism is served (docs/tensor-parallel.md); a rank outside the group is not.
  auto tp = spawnDecode({"--check-config", "--decode.tensor_parallel", "2"}, false);
  EXPECT_EQ(tp->wait(30s), std::optional<int>(0));
  auto bad = spawnDecode({"--check-config", "--decode.tensor_parallel", "2", "--decode.tp_rank", "2"}, true);
  proc::LineReader err(bad->stderrFd());
  EXPECT_EQ(bad->wait(30s), std::optional<int>(2));
  const auto line = err.next(5s);
  ASSERT_TRUE(line.has_value());
  EXPECT_NE(line->find("tensor_parallel"), std::string::npos) << *line;

  auto typo = spawnDecode({"--check-config", "--decode.num_blockz", "3"}, false);
  EXPECT_EQ(typo->wait(30s), std::optional<int>(2));
}

TEST(DecodeWorkerProcess, ServesThenDrainsOnSigtermAndExitsZero) {
  auto p = spawnDecode({"--decode.port", "0", "--decode.num_blocks", "32", "--decode.block_size", "16",
                        "--decode.threads", "1", "--decode.drain_timeout_ms", std::to_string(kDrain.count())},
                       false);
  proc::LineReader out(p->stdoutFd());
  const auto ready = out.next(60s);
  ASSERT_TRUE(ready.has_value()) << "no PDSERVE_READY line";
  const std::string prefix = "PDSERVE_READY role=decode url=http://127.0.0.1:";
  ASSERT_EQ(ready->rfind(prefix, 0), 0U) << *ready;
  const auto port = static_cast<std::uint16_t>(std::stoi(ready->substr(prefix.size())));

  EXPECT_EQ(send(port, "GET", "/health").status, 200);
  EXPECT_EQ(send(port, "GET", "/ready").status, 200);
  const http::ClientResponse metrics = send(port, "GET", "/metrics");
  EXPECT_EQ(metrics.status, 200);
  EXPECT_NE(metrics.body.find("pdserve_kv_blocks_total 32"), std::string::npos) << metrics.body;
  EXPECT_NE(metrics.body.find("pdserve_kv_registered_regions 1"), std::string::npos);
  EXPECT_NE(metrics.body.find("# TYPE pdserve_decode_step_seconds histogram"), std::string::npos);
  const http::ClientResponse st = send(port, "GET", std::string(api::kStatusPath));
  auto status = api::parseWorkerStatus(st.body);
  ASSERT_TRUE(status.ok()) << st.body;
  EXPECT_EQ(status->role, "decode");
  EXPECT_TRUE(status->ready);
  EXPECT_EQ(status->total_blocks, 32);
  // The CPU engine's pool: host memory, decode.kv_dtype, 32 blocks x 16 tokens x 2 bytes x the
  // model's KV layers and latent width.
  EXPECT_EQ(status->kv_pool_memory, "host");
  EXPECT_EQ(status->kv_cache_dtype, "bf16");
  EXPECT_GT(status->kv_pool_bytes, 0);
  EXPECT_EQ(status->kv_pool_bytes % (32 * 16 * 2), 0) << status->kv_pool_bytes;
  EXPECT_EQ(status->free_blocks, 32);
  EXPECT_EQ(status->block_size, 16);
  EXPECT_EQ(status->model_hash.size(), 16U);
  EXPECT_EQ(send(port, "GET", "/nope").status, 404);

  // A stream that waits for KV that never comes holds the drain up until its timeout.
  std::vector<std::string> lines;
  std::optional<Result<http::ClientResponse>> stream_result;
  std::thread reader([&] {
    http::Client client("127.0.0.1", port);
    http::ClientRequest req;
    req.method = "POST";
    req.target = std::string(api::kDecodeOpenPath);
    req.body = openBody("cmpl-held");
    stream_result.emplace(client.streamLines(req, 60s, [&](std::string_view l) {
      lines.emplace_back(l);
      return true;
    }));
  });
  const auto queued = [&] {
    auto s = api::parseWorkerStatus(send(port, "GET", std::string(api::kStatusPath)).body);
    return s.ok() ? s->queued_requests : -1;
  };
  for (const auto until = Clock::now() + 60s; queued() != 1 && Clock::now() < until;) {
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_EQ(queued(), 1) << "the stream was not admitted";

  const auto signalled = Clock::now();
  EXPECT_TRUE(p->signal(SIGTERM));
  // Ordered by the event, not a sleep: /ready turns 503 once the worker has taken the signal.
  int ready_status = 0;
  for (const auto until = Clock::now() + kDrain; ready_status != 503 && Clock::now() < until;) {
    ready_status = send(port, "GET", "/ready").status;
    if (ready_status != 503) std::this_thread::sleep_for(5ms);
  }
  EXPECT_EQ(ready_status, 503);
  const http::ClientResponse refused = send(port, "POST", std::string(api::kDecodeOpenPath), openBody("cmpl-late"));
  EXPECT_EQ(refused.status, 503);
  EXPECT_EQ(api::parseErrorJson(refused.status, refused.body).code, ErrorCode::Overloaded) << refused.body;

  const auto code = p->wait(kDrain + 20s);
  const auto took = Clock::now() - signalled;
  reader.join();
  EXPECT_EQ(code, std::optional<int>(0));
  EXPECT_GE(took, kDrain - 100ms) << "the open stream was not given the drain time";
  EXPECT_LT(took, kDrain + 10s);
  ASSERT_TRUE(stream_result.has_value());
  ASSERT_TRUE(stream_result->ok()) << stream_result->error().toString();
  ASSERT_EQ(lines.size(), 2U);
  auto first = api::parseDecodeEvent(lines[0]);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(first->type, api::DecodeEventType::Descriptor);
  auto last = api::parseDecodeEvent(lines[1]);
  ASSERT_TRUE(last.ok()) << lines[1];
  EXPECT_EQ(last->type, api::DecodeEventType::Error);
  EXPECT_EQ(last->code, ErrorCode::Cancelled);
}

}  // namespace
}  // namespace pd
