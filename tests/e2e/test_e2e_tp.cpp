// Tensor-parallel decode through real processes (docs/tensor-parallel.md): `pdserve decode
// --decode.tensor_parallel 2` (which spawns its rank-1 follower itself), a real `pdserve prefill`
// writing the prompt's KV over UCX into both ranks' pools, and a real `pdserve router` in front.
//  - Golden: /v1/completions on the golden prompt ids at temperature 0 returns exactly the golden
//    greedy tokens, for tiny-bf16 and tiny-fp8, MTP off and on; the pool is free afterwards; a
//    SIGTERM drain stops the follower cleanly (the leader exits 0 at once, the follower is gone,
//    nothing is left in /dev/shm).
//  - Follower death: kill -9 of the follower turns the leader's /ready to 503 within a second,
//    a decode open then fails at once with PeerFailed (never hangs), and the leader still drains
//    and exits 0; a request streaming when the follower dies ends at once with an error, its
//    blocks freed (decode slowed by the test-only decode.tp_inject_latency_us so that it is
//    surely mid-stream).
// The processes are found through /proc (the leader is this test's child, the follower the
// leader's).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <boost/json.hpp>
#include <chrono>
#include <filesystem>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "pd/common/http_client.h"
#include "pd/common/worker_api.h"
#include "support/role_process.h"
#include "support/test_files.h"

namespace pd::test {
namespace {

namespace json = boost::json;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

struct GoldenPrompt {
  std::vector<std::int64_t> tokens;
  std::vector<std::int64_t> greedy;
};

GoldenPrompt goldenPrompt(const std::string& model) {
  const auto doc = json::parse(readFile(goldenDir() / model / "golden.json"));
  const auto& p = doc.at("prompts").as_array().at(0).as_object();
  GoldenPrompt g;
  for (const auto& t : p.at("tokens").as_array()) g.tokens.push_back(t.to_number<std::int64_t>());
  for (const auto& t : p.at("greedy").as_array()) g.greedy.push_back(t.to_number<std::int64_t>());
  return g;
}

// Process `pid`'s parent and command line (empty when it is gone).
struct ProcInfo {
  int ppid = 0;
  std::string cmdline;  // arguments joined by spaces
};

// The whole of a /proc file (their size reads as 0, so read until EOF); empty if unreadable.
std::string readProcFile(const std::string& path) {
  std::string out;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return out;
  char buf[4096];
  ssize_t n = 0;
  while ((n = ::read(fd, buf, sizeof(buf))) > 0) out.append(buf, static_cast<std::size_t>(n));
  ::close(fd);
  return out;
}

std::optional<ProcInfo> procInfo(int pid) {
  const std::string text = readProcFile("/proc/" + std::to_string(pid) + "/stat");
  const auto close = text.rfind(')');  // "pid (comm) state ppid ..."
  if (close == std::string::npos || close + 2 >= text.size()) return std::nullopt;
  std::istringstream rest(text.substr(close + 2));
  std::string state;
  ProcInfo info;
  rest >> state >> info.ppid;
  if (state == "Z" || state == "X") return std::nullopt;
  std::string raw = readProcFile("/proc/" + std::to_string(pid) + "/cmdline");
  for (char& c : raw) c = c == '\0' ? ' ' : c;
  info.cmdline = raw;
  return info;
}

// Live children of `parent` whose command line contains `needle`.
std::vector<int> childrenOf(int parent, const std::string& needle) {
  std::vector<int> out;
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    const std::string name = entry.path().filename().string();
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
    const int pid = std::stoi(name);
    const auto info = procInfo(pid);
    if (info && info->ppid == parent && info->cmdline.find(needle) != std::string::npos) out.push_back(pid);
  }
  return out;
}

bool alive(int pid) {
  return procInfo(pid).has_value();
}

bool shmGroupLeft(int leader_pid) {
  const std::string prefix = "pdserve-tp-" + std::to_string(leader_pid) + "-";
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
    if (entry.path().filename().string().starts_with(prefix)) return true;
  }
  return false;
}

int getStatus(const RoleProcess& w, const std::string& path) {
  http::Client client(w.host(), w.port());
  http::ClientRequest req;
  req.target = path;
  auto r = client.send(req, 10s);
  return r.ok() ? r->status : -1;
}

worker_api::WorkerStatus workerStatus(const RoleProcess& w) {
  http::Client client(w.host(), w.port());
  http::ClientRequest req;
  req.target = std::string(worker_api::kStatusPath);
  auto r = client.send(req, 10s);
  EXPECT_TRUE(r.ok() && r->status == 200);
  if (!r.ok()) return {};
  auto st = worker_api::parseWorkerStatus(r->body);
  EXPECT_TRUE(st.ok()) << (st.ok() ? "" : st.error().toString());
  return st.ok() ? *st : worker_api::WorkerStatus{};
}

class TpCluster {
 public:
  TpCluster(const std::string& model, int mtp, const std::vector<std::string>& extra_decode_flags = {})
      : model_dir_(goldenDir() / model) {
    const std::vector<std::string> common = {"--model.path=" + model_dir_.string(),
                                             "--model.tokenizer=" PD_TOKENIZER_DIR,
                                             "--model.cache_dir=" + cache_.path().string(), "--log.level=warn"};
    auto with = [&common](std::vector<std::string> flags) {
      flags.insert(flags.begin(), common.begin(), common.end());
      return flags;
    };
    std::vector<std::string> decode_flags = {"--decode.port=0", "--decode.tensor_parallel=2", "--decode.threads=1",
                                             "--decode.num_blocks=128",
                                             "--decode.num_speculative_tokens=" + std::to_string(mtp)};
    decode_flags.insert(decode_flags.end(), extra_decode_flags.begin(), extra_decode_flags.end());
    decode_ = std::make_unique<RoleProcess>("decode", with(std::move(decode_flags)));
    prefill_ = std::make_unique<RoleProcess>("prefill", with({"--prefill.port=0", "--prefill.threads=1"}));
    if (!decode_->ready() || !prefill_->ready()) return;
    router_ = std::make_unique<RoleProcess>(
        "router", with({"--router.port=0", "--router.prefill_workers=" + prefill_->hostPort(),
                        "--router.decode_workers=" + decode_->hostPort(), "--router.request_timeout_ms=60000"}));
    // The router prints READY when it listens; it routes once its first polls put both workers
    // in rotation (its /ready).
    const auto deadline = Clock::now() + 30s;
    while (router_->ready() && getStatus(*router_, "/ready") != 200 && Clock::now() < deadline) {
      std::this_thread::sleep_for(50ms);
    }
  }

  // Router first: stopped before the workers it talks to.
  ~TpCluster() {
    router_.reset();
    prefill_.reset();
    decode_.reset();
  }
  TpCluster(const TpCluster&) = delete;
  TpCluster& operator=(const TpCluster&) = delete;

  [[nodiscard]] bool ready() const { return router_ && router_->ready(); }
  RoleProcess& decode() { return *decode_; }
  RoleProcess& router() { return *router_; }

  // The leader's pid (our child running `decode`) and its follower's.
  [[nodiscard]] int leaderPid() const {
    const auto pids = childrenOf(static_cast<int>(getpid()), " decode ");
    EXPECT_EQ(pids.size(), 1U) << "decode leader processes";
    return pids.empty() ? -1 : pids.front();
  }
  [[nodiscard]] static int followerPid(int leader) {
    const auto pids = childrenOf(leader, "--decode.tp_rank 1");
    EXPECT_EQ(pids.size(), 1U) << "tensor-parallel followers of " << leader;
    return pids.empty() ? -1 : pids.front();
  }

  // One completion of the golden prompt; the token ids, or nullopt (with a test failure).
  std::optional<std::vector<std::int64_t>> complete(const GoldenPrompt& golden) {
    json::array prompt;
    for (auto t : golden.tokens) prompt.push_back(t);
    const json::object body{{"model", "pdserve-default"},
                            {"prompt", prompt},
                            {"max_tokens", golden.greedy.size()},
                            {"temperature", 0},
                            {"return_token_ids", true}};
    http::Client client(router_->host(), router_->port());
    http::ClientRequest req;
    req.method = "POST";
    req.target = "/v1/completions";
    req.headers.push_back({"Content-Type", "application/json"});
    req.body = json::serialize(body);
    auto r = client.send(req, 120s);
    if (!r.ok()) {
      ADD_FAILURE() << r.error().toString();
      return std::nullopt;
    }
    if (r->status != 200) {
      ADD_FAILURE() << r->status << " " << r->body;
      return std::nullopt;
    }
    const auto doc = json::parse(r->body);
    const auto& choice = doc.at("choices").as_array().at(0).as_object();
    std::vector<std::int64_t> ids;
    for (const auto& t : choice.at("token_ids").as_array()) ids.push_back(t.to_number<std::int64_t>());
    EXPECT_EQ(choice.at("finish_reason").as_string(), "length");
    return ids;
  }

 private:
  std::filesystem::path model_dir_;
  TempDir cache_;
  std::unique_ptr<RoleProcess> decode_;
  std::unique_ptr<RoleProcess> prefill_;
  std::unique_ptr<RoleProcess> router_;
};

class E2eTp : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(E2eTp, GoldenGreedyTokensThroughATwoRankDecodeWorkerThenACleanDrain) {
  const auto& [model, mtp] = GetParam();
  const GoldenPrompt golden = goldenPrompt(model);
  TpCluster cluster(model, mtp);
  ASSERT_TRUE(cluster.ready());
  const int leader = cluster.leaderPid();
  ASSERT_GT(leader, 0);
  const int follower = TpCluster::followerPid(leader);
  ASSERT_GT(follower, 0);

  for (int round = 0; round < 2; ++round) {  // the second round reuses freed blocks
    const auto ids = cluster.complete(golden);
    ASSERT_TRUE(ids.has_value());
    EXPECT_EQ(*ids, golden.greedy) << "round " << round;
  }
  const auto st = workerStatus(cluster.decode());
  EXPECT_GT(st.total_blocks, 0);
  EXPECT_EQ(st.free_blocks, st.total_blocks) << "KV blocks leaked";
  EXPECT_EQ(st.running_requests, 0);
  EXPECT_FALSE(shmGroupLeft(leader)) << "the group's shm name must be unlinked once joined";

  // Drain: the leader stops its follower (which exits by itself, no kill after 10 s) and exits 0.
  const auto start = Clock::now();
  ASSERT_TRUE(cluster.decode().signal(SIGTERM));
  const auto status = cluster.decode().wait(60s);
  ASSERT_TRUE(status.has_value()) << "the TP leader did not exit";
  EXPECT_EQ(*status, 0);
  EXPECT_LT(Clock::now() - start, 8s) << "the follower was not stopped cleanly (killed after the 10 s wait?)";
  EXPECT_FALSE(alive(follower)) << "the follower outlived its leader";
}

INSTANTIATE_TEST_SUITE_P(Models, E2eTp,
                         ::testing::Combine(::testing::Values("tiny-bf16", "tiny-fp8"), ::testing::Values(0, 1)),
                         [](const auto& param_info) {
                           std::string name =
                               std::get<0>(param_info.param) + "_mtp" + std::to_string(std::get<1>(param_info.param));
                           for (auto& ch : name) ch = (ch == '-') ? '_' : ch;
                           return name;
                         });

TEST(E2eTpFaults, AFollowerThatDiesFailsTheLeadersRequestsCleanlyAndItsReadiness) {
  const GoldenPrompt golden = goldenPrompt("tiny-bf16");
  TpCluster cluster("tiny-bf16", 1);
  ASSERT_TRUE(cluster.ready());
  const int leader = cluster.leaderPid();
  ASSERT_GT(leader, 0);
  const int follower = TpCluster::followerPid(leader);
  ASSERT_GT(follower, 0);
  ASSERT_TRUE(cluster.complete(golden).has_value());  // the group works before the fault
  EXPECT_EQ(getStatus(cluster.decode(), "/ready"), 200);

  ASSERT_EQ(::kill(follower, SIGKILL), 0);
  // /ready turns 503 without any traffic (the leader watches its followers).
  const auto deadline = Clock::now() + 5s;
  int ready = 0;
  while (Clock::now() < deadline && (ready = getStatus(cluster.decode(), "/ready")) != 503) {
    std::this_thread::sleep_for(50ms);
  }
  EXPECT_EQ(ready, 503) << "/ready after the follower died";
  EXPECT_FALSE(workerStatus(cluster.decode()).ready);

  // A decode open fails at once with PeerFailed: nothing hangs, nothing is held.
  worker_api::DecodeOpen open;
  open.request_id = "after-follower-death";
  open.prompt_tokens = static_cast<std::int64_t>(golden.tokens.size());
  open.max_tokens = 4;
  http::Client client(cluster.decode().host(), cluster.decode().port());
  http::ClientRequest req;
  req.method = "POST";
  req.target = std::string(worker_api::kDecodeOpenPath);
  req.headers.push_back({"Content-Type", "application/json"});
  req.body = worker_api::toJson(open);
  const auto start = Clock::now();
  auto r = client.send(req, 30s);
  ASSERT_TRUE(r.ok()) << r.error().toString();
  EXPECT_LT(Clock::now() - start, 5s);
  EXPECT_NE(r->status, 200) << r->body;
  EXPECT_NE(r->body.find("PeerFailed"), std::string::npos) << r->body;
  const auto st = workerStatus(cluster.decode());
  EXPECT_EQ(st.free_blocks, st.total_blocks);

  // The leader still drains and exits 0.
  ASSERT_TRUE(cluster.decode().signal(SIGTERM));
  const auto status = cluster.decode().wait(60s);
  ASSERT_TRUE(status.has_value());
  EXPECT_EQ(*status, 0);
}

TEST(E2eTpFaults, ARequestStreamingWhenTheFollowerDiesEndsWithAnErrorAtOnce) {
  // 2 ms per message: a decode step of the 3-layer model is about ten messages, so 200 tokens
  // take seconds and the kill surely lands mid-stream.
  TpCluster cluster("tiny-bf16", 0, {"--decode.tp_inject_latency_us=2000"});
  ASSERT_TRUE(cluster.ready());
  const int leader = cluster.leaderPid();
  ASSERT_GT(leader, 0);
  const int follower = TpCluster::followerPid(leader);
  ASSERT_GT(follower, 0);

  constexpr int kMaxTokens = 200;
  http::Client client(cluster.router().host(), cluster.router().port());
  http::ClientRequest req;
  req.method = "POST";
  req.target = "/v1/completions";
  req.headers = {{"Content-Type", "application/json"}};
  req.body = json::serialize(json::object{{"model", "pdserve-default"},
                                          {"prompt", json::array{11, 12, 13, 14, 15, 16, 17, 18}},
                                          {"max_tokens", kMaxTokens},
                                          {"ignore_eos", true},
                                          {"temperature", 0},
                                          {"stream", true},
                                          {"return_token_ids", true}});
  int tokens = 0;
  bool error_event = false;
  std::string finish;
  std::optional<Clock::time_point> killed;
  const auto response = client.streamEvents(req, 60s, [&](const http::SseEvent& event) {
    if (event.data == "[DONE]") return true;
    const auto doc = json::parse(event.data);
    if (doc.as_object().contains("error")) {
      error_event = true;
      return true;
    }
    for (const auto& c : doc.at("choices").as_array()) {
      const auto& choice = c.as_object();
      if (const auto* ids = choice.if_contains("token_ids"); ids != nullptr && ids->is_array()) {
        tokens += static_cast<int>(ids->as_array().size());
      }
      if (const auto* f = choice.if_contains("finish_reason"); f != nullptr && f->is_string()) {
        finish = std::string(f->as_string());
      }
    }
    if (!killed && tokens >= 5) {
      EXPECT_EQ(::kill(follower, SIGKILL), 0);
      killed = Clock::now();
    }
    return true;
  });
  ASSERT_TRUE(killed.has_value()) << "the stream ended before the kill: " << tokens << " tokens";
  EXPECT_LT(Clock::now() - *killed, 10s) << "the stream did not end soon after the follower died";
  EXPECT_LT(tokens, kMaxTokens) << "the request finished as if nothing happened";
  EXPECT_NE(finish, "length");
  // The router reports the failure as an error event, a cut stream or an error finish reason.
  EXPECT_TRUE(error_event || !response.ok() || (finish != "stop" && finish != "length"))
      << "no error reached the client (finish '" << finish << "')";

  // The leader freed the request's blocks and is not ready; it still drains and exits 0.
  const auto deadline = Clock::now() + 10s;
  worker_api::WorkerStatus st = workerStatus(cluster.decode());
  while (Clock::now() < deadline && (st.free_blocks != st.total_blocks || st.running_requests != 0)) {
    std::this_thread::sleep_for(100ms);
    st = workerStatus(cluster.decode());
  }
  EXPECT_EQ(st.free_blocks, st.total_blocks);
  EXPECT_EQ(st.running_requests, 0);
  EXPECT_EQ(getStatus(cluster.decode(), "/ready"), 503);
  ASSERT_TRUE(cluster.decode().signal(SIGTERM));
  const auto status = cluster.decode().wait(60s);
  ASSERT_TRUE(status.has_value());
  EXPECT_EQ(*status, 0);
}

}  // namespace
}  // namespace pd::test
