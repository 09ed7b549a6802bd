// The router's worker-failure statuses through real processes: 429 + Retry-After when its queue
// limit is hit, 504 when a decode worker does not answer in time, 502 when it is gone — each with
// an OpenAI-style error body — and afterwards the surviving workers hold nothing.
#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <boost/json.hpp>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "pd/common/http_client.h"
#include "pd/common/subprocess.h"
#include "pd/common/worker_api.h"
#include "support/role_process.h"
#include "support/test_files.h"
#include "support/test_model.h"

namespace pd::test {
namespace {

namespace json = boost::json;
using namespace std::chrono_literals;

class E2eErrors : public DefaultModelSuite<E2eErrors> {
 protected:
  // One decode and one prefill worker, and a router over them with `router_flags`.
  void start(std::vector<std::string> router_flags) {
    const std::string model = "--model.path=" + modelDir();
    decode_ = std::make_unique<RoleProcess>(
        "decode", std::vector<std::string>{model, "--decode.port=0", "--decode.threads=1", "--log.level=warn"});
    prefill_ = std::make_unique<RoleProcess>(
        "prefill", std::vector<std::string>{model, "--prefill.port=0", "--prefill.threads=1", "--log.level=warn"});
    ASSERT_TRUE(decode_->ready());
    ASSERT_TRUE(prefill_->ready());
    std::vector<std::string> flags = {model, "--router.port=0", "--router.prefill_workers=" + prefill_->hostPort(),
                                      "--router.decode_workers=" + decode_->hostPort(), "--log.level=warn"};
    flags.insert(flags.end(), router_flags.begin(), router_flags.end());
    router_ = std::make_unique<RoleProcess>("router", flags);
    ASSERT_TRUE(router_->ready());
    // Ready once the first health poll has seen both workers.
    for (int i = 0; i < 100; ++i) {
      if (get(*router_, "/ready").status == 200) return;
      std::this_thread::sleep_for(100ms);
    }
    FAIL() << "router never became ready";
  }

  static http::ClientResponse get(const RoleProcess& p, const std::string& path) {
    http::Client client(p.host(), p.port());
    http::ClientRequest req;
    req.target = path;
    auto r = client.send(req, 10s);
    return r.ok() ? *r : http::ClientResponse{};
  }

  http::ClientResponse complete(int max_tokens, std::chrono::seconds timeout = 60s) {
    http::Client client(router_->host(), router_->port());
    http::ClientRequest req;
    req.method = "POST";
    req.target = "/v1/completions";
    req.headers = {{"Content-Type", "application/json"}};
    std::string prompt = "Once upon a time";
    for (int i = 0; i < 60; ++i) prompt += " there was a long road " + std::to_string(i) + ",";
    req.body = json::serialize(json::object{{"model", "pdserve-default"},
                                            {"prompt", prompt},
                                            {"max_tokens", max_tokens},
                                            {"ignore_eos", true},
                                            {"temperature", 0}});
    auto r = client.send(req, timeout);
    EXPECT_TRUE(r.ok()) << (r.ok() ? "" : r.error().toString());
    return r.ok() ? *r : http::ClientResponse{};
  }

  static void expectOpenAiError(const http::ClientResponse& r, int status) {
    EXPECT_EQ(r.status, status) << r.body;
    json::error_code ec;
    const auto doc = json::parse(r.body, ec);
    ASSERT_FALSE(ec) << r.body;
    ASSERT_TRUE(doc.is_object() && doc.as_object().contains("error")) << r.body;
    EXPECT_TRUE(doc.at("error").at("message").is_string());
    EXPECT_TRUE(doc.at("error").at("type").is_string());
    // 5xx messages carry no internal detail such as worker addresses.
    if (status >= 500) {
      EXPECT_EQ(r.body.find("127.0.0.1"), std::string::npos) << r.body;
    }
  }

  void expectDecodeClean() {
    for (int i = 0; i < 100; ++i) {
      const auto r = get(*decode_, std::string(worker_api::kStatusPath));
      auto st = worker_api::parseWorkerStatus(r.body);
      if (st.ok() && st->free_blocks == st->total_blocks && st->running_requests == 0 && st->queued_requests == 0) {
        return;
      }
      std::this_thread::sleep_for(100ms);
    }
    ADD_FAILURE() << "decode worker still holds KV blocks or requests";
  }

  std::unique_ptr<RoleProcess> decode_;
  std::unique_ptr<RoleProcess> prefill_;
  std::unique_ptr<RoleProcess> router_;
};

TEST_F(E2eErrors, QueueLimitAnswers429WithRetryAfter) {
  start({"--router.max_queued_requests=1", "--router.retry_after_s=2"});
  std::vector<http::ClientResponse> responses(8);
  std::vector<std::thread> threads;
  for (std::size_t i = 0; i < responses.size(); ++i) {
    threads.emplace_back([&, i] { responses[i] = complete(64); });
  }
  for (auto& t : threads) t.join();
  int ok = 0;
  int limited = 0;
  for (const auto& r : responses) {
    if (r.status == 200) {
      ++ok;
    } else {
      expectOpenAiError(r, 429);
      EXPECT_EQ(r.header("Retry-After"), "2");
      ++limited;
    }
  }
  EXPECT_GE(ok, 1);
  EXPECT_GE(limited, 1) << "eight concurrent requests never hit a queue limit of one";
  expectDecodeClean();
}

TEST_F(E2eErrors, SilentDecodeWorkerAnswers504) {
  // Health polls are rare here, so the stopped worker stays in rotation and the request meets it.
  start({"--router.health_interval_ms=600000", "--router.decode_retries=0", "--router.decode_open_timeout_ms=1500"});
  ASSERT_TRUE(decode_->signal(SIGSTOP));
  const auto started = std::chrono::steady_clock::now();
  const auto r = complete(8);
  expectOpenAiError(r, 504);
  EXPECT_LT(std::chrono::steady_clock::now() - started, 20s);
  ASSERT_TRUE(decode_->signal(SIGCONT));
  expectDecodeClean();
}

TEST_F(E2eErrors, DeadDecodeWorkerAnswers502) {
  start({"--router.health_interval_ms=600000", "--router.decode_retries=0"});
  ASSERT_TRUE(decode_->signal(SIGKILL));
  ASSERT_TRUE(decode_->wait(10s).has_value());
  const auto r = complete(8);
  expectOpenAiError(r, 502);
}

}  // namespace
}  // namespace pd::test
