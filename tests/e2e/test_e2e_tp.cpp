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
//  - Across nodes: decode TP 2 and 4 over two decode processes joined over TCP (node 1 spawns its
//    second rank for TP 4): golden tokens, node 1's probes, node 1 ignoring SIGTERM until the
//    leader's drain stops the group (both exit 0); node 1 killed → the leader's /ready 503 and
//    PeerFailed at once; the leader killed → node 1 (and its spawned rank) exit 1, no hang.
//  - Prefill TP 2: golden tokens through a two-rank prefill worker; its rank 1 killed → /ready
//    503, requests fail cleanly, the worker still drains and exits 0.
// The processes are found through /proc (the leader is this test's child, the follower the
// leader's).
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
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
#include "support/metrics_text.h"
#include "support/role_process.h"
#include "support/router_serving.h"
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

// /ready of `w` polled for up to 5 s until it answers 503; the last answer.
int readyWithin5s(const RoleProcess& w) {
  const auto deadline = Clock::now() + 5s;
  int ready = getStatus(w, "/ready");
  while (ready != 503 && Clock::now() < deadline) {
    std::this_thread::sleep_for(50ms);
    ready = getStatus(w, "/ready");
  }
  return ready;
}

// A decode open of the golden prompt (4 new tokens) for `id`, as the router would send it.
worker_api::DecodeOpen goldenOpen(const GoldenPrompt& golden, const std::string& id) {
  worker_api::DecodeOpen open;
  open.request_id = id;
  open.prompt_tokens = static_cast<std::int64_t>(golden.tokens.size());
  open.max_tokens = 4;
  return open;
}

// POSTs `open` straight to the decode worker's internal API.
Result<http::ClientResponse> postOpen(const RoleProcess& decode, const worker_api::DecodeOpen& open,
                                      std::chrono::seconds timeout) {
  http::Client client(decode.host(), decode.port());
  http::ClientRequest req;
  req.method = "POST";
  req.target = std::string(worker_api::kDecodeOpenPath);
  req.headers.push_back({"Content-Type", "application/json"});
  req.body = worker_api::toJson(open);
  return client.send(req, timeout);
}

// A decode open on a worker whose group is broken fails at once with PeerFailed, holding no block.
void expectOpenFailsAtOnce(const RoleProcess& decode, const GoldenPrompt& golden, const std::string& id) {
  const auto start = Clock::now();
  auto r = postOpen(decode, goldenOpen(golden, id), 30s);
  ASSERT_TRUE(r.ok()) << r.error().toString();
  EXPECT_LT(Clock::now() - start, 5s);
  EXPECT_NE(r->status, 200) << r->body;
  EXPECT_NE(r->body.find("PeerFailed"), std::string::npos) << r->body;
  const auto st = workerStatus(decode);
  EXPECT_EQ(st.free_blocks, st.total_blocks);
}

// Free TCP port on the loopback interface (for a rendezvous address the test must know first).
int freePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  int port = -1;
  if (fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  if (fd >= 0) ::close(fd);
  return port;
}

// Where the ranks run: decode_tp ranks over `nnodes` decode processes started by the test (> 1: a
// multi-node group joined over TCP at a loopback rendezvous, each node spawning decode_tp/nnodes-1
// ranks), and a prefill worker of prefill_tp ranks.
struct TpLayout {
  int decode_tp = 2;
  int nnodes = 1;
  int prefill_tp = 1;
};

class TpCluster {
 public:
  TpCluster(const std::string& model, int mtp, const std::vector<std::string>& extra_decode_flags = {},
            TpLayout layout = {}, const std::vector<std::string>& extra_router_flags = {})
      : model_dir_(goldenDir() / model) {
    const std::vector<std::string> common = {"--model.path=" + model_dir_.string(),
                                             "--model.tokenizer=" PD_TOKENIZER_DIR,
                                             "--model.cache_dir=" + cache_.path().string(), "--log.level=warn"};
    auto with = [&common](std::vector<std::string> flags) {
      flags.insert(flags.begin(), common.begin(), common.end());
      return flags;
    };
    std::vector<std::string> decode_flags = {
        "--decode.port=0", "--decode.tensor_parallel=" + std::to_string(layout.decode_tp), "--decode.threads=1",
        "--decode.num_blocks=128", "--decode.num_speculative_tokens=" + std::to_string(mtp)};
    decode_flags.insert(decode_flags.end(), extra_decode_flags.begin(), extra_decode_flags.end());
    if (layout.nnodes > 1) {
      decode_flags.push_back("--decode.nnodes=" + std::to_string(layout.nnodes));
      decode_flags.push_back("--decode.dist_init_address=127.0.0.1:" + std::to_string(freePort()));
    }
    // Nodes 1.. first (they wait at the rendezvous for node 0), then node 0, the leader.
    other_nodes_.resize(static_cast<std::size_t>(layout.nnodes - 1));
    for (int n = layout.nnodes - 1; n >= 0; --n) {
      std::vector<std::string> flags = decode_flags;
      if (layout.nnodes > 1) flags.push_back("--decode.node_rank=" + std::to_string(n));
      auto p = std::make_unique<RoleProcess>("decode", with(std::move(flags)), std::chrono::seconds{0});
      if (n == 0) {
        decode_ = std::move(p);
      } else {
        other_nodes_[static_cast<std::size_t>(n - 1)] = std::move(p);
      }
    }
    prefill_ = std::make_unique<RoleProcess>("prefill",
                                             with({"--prefill.port=0", "--prefill.threads=1",
                                                   "--prefill.tensor_parallel=" + std::to_string(layout.prefill_tp)}));
    if (!decode_->waitReady()) return;
    for (auto& node : other_nodes_) {
      if (!node->waitReady()) return;
    }
    if (!prefill_->ready()) return;
    std::vector<std::string> router_flags{"--router.port=0", "--router.prefill_workers=" + prefill_->hostPort(),
                                          "--router.decode_workers=" + decode_->hostPort(),
                                          "--router.request_timeout_ms=60000"};
    router_flags.insert(router_flags.end(), extra_router_flags.begin(), extra_router_flags.end());
    router_ = std::make_unique<RoleProcess>("router", with(std::move(router_flags)));
    // The router prints READY when it listens; it routes once its first polls put both workers
    // in rotation (its /ready).
    const auto deadline = Clock::now() + 30s;
    while (router_->ready() && getStatus(*router_, "/ready") != 200 && Clock::now() < deadline) {
      std::this_thread::sleep_for(50ms);
    }
  }

  // Router first: stopped before the workers it talks to; the leader before the other nodes (they
  // ignore SIGTERM and exit once the leader stops the group).
  ~TpCluster() {
    router_.reset();
    prefill_.reset();
    decode_.reset();
    other_nodes_.clear();
  }
  TpCluster(const TpCluster&) = delete;
  TpCluster& operator=(const TpCluster&) = delete;

  [[nodiscard]] bool ready() const { return router_ && router_->ready(); }
  RoleProcess& decode() { return *decode_; }
  RoleProcess& prefill() { return *prefill_; }
  RoleProcess& node(int n) { return *other_nodes_.at(static_cast<std::size_t>(n - 1)); }
  RoleProcess& router() { return *router_; }

  // The leader's pid (our child running `decode` as node 0) and its follower's.
  [[nodiscard]] int leaderPid() const { return decode_->pid(); }
  [[nodiscard]] static int followerPid(int leader, const std::string& flag = "--decode.tp_rank 1") {
    const auto pids = childrenOf(leader, flag);
    EXPECT_EQ(pids.size(), 1U) << "tensor-parallel ranks '" << flag << "' of " << leader;
    return pids.empty() ? -1 : pids.front();
  }

  // One completion of the golden prompt; the token ids, or nullopt (with a test failure).
  std::optional<std::vector<std::int64_t>> complete(const GoldenPrompt& golden) {
    auto all = completeN(golden, 1);
    if (!all) return std::nullopt;
    return all->at(0);
  }

  // A completion of the golden prompt with `n` choices: each choice's token ids, by index.
  std::optional<std::vector<std::vector<std::int64_t>>> completeN(const GoldenPrompt& golden, int n) {
    json::array prompt;
    for (auto t : golden.tokens) prompt.push_back(t);
    const json::object body{{"model", "pdserve-default"}, {"prompt", prompt}, {"max_tokens", golden.greedy.size()},
                            {"temperature", 0},           {"n", n},           {"return_token_ids", true}};
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
    const auto& choices = doc.at("choices").as_array();
    EXPECT_EQ(choices.size(), static_cast<std::size_t>(n));
    std::vector<std::vector<std::int64_t>> all(choices.size());
    for (const auto& c : choices) {
      const auto& choice = c.as_object();
      const auto index = static_cast<std::size_t>(choice.at("index").to_number<std::int64_t>());
      if (index >= all.size()) {
        ADD_FAILURE() << "choice index " << index << " in " << r->body;
        return std::nullopt;
      }
      for (const auto& t : choice.at("token_ids").as_array()) all[index].push_back(t.to_number<std::int64_t>());
      EXPECT_EQ(choice.at("finish_reason").as_string(), "length");
    }
    return all;
  }

 private:
  std::filesystem::path model_dir_;
  TempDir cache_;
  std::unique_ptr<RoleProcess> decode_;
  std::vector<std::unique_ptr<RoleProcess>> other_nodes_;  // decode nodes 1..
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
  // n > 1: a tensor-parallel decode worker cannot share one prompt among choices; the router
  // serves each choice alone, and greedy choices all equal the golden tokens.
  const auto choices = cluster.completeN(golden, 2);
  ASSERT_TRUE(choices.has_value());
  for (const auto& ids : *choices) EXPECT_EQ(ids, golden.greedy) << "a choice of n = 2";
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
  EXPECT_EQ(readyWithin5s(cluster.decode()), 503) << "/ready after the follower died";
  EXPECT_FALSE(workerStatus(cluster.decode()).ready);

  // A decode open fails at once with PeerFailed: nothing hangs, nothing is held.
  expectOpenFailsAtOnce(cluster.decode(), golden, "after-follower-death");

  // The leader still drains and exits 0.
  ASSERT_TRUE(cluster.decode().signal(SIGTERM));
  const auto status = cluster.decode().wait(60s);
  ASSERT_TRUE(status.has_value());
  EXPECT_EQ(*status, 0);
}

// Conditional disaggregation with a tensor-parallel decode worker. The worker prefills nothing
// itself (its local prefill would run over a scratch cache of the leader's alone, which the
// follower's forwards cannot follow) and says so in its status (local_prefill_max_tokens 0). A
// router with remote_prefill_min_tokens set therefore sends its short prompts to the prefill
// worker: the golden tokens come back, counted as reason worker_limit. A local open sent to the
// worker anyway is refused with a clean error, and the group stays whole: the follower lives,
// /ready stays 200, nothing is held, and it still serves.
TEST(E2eTpFaults, ShortPromptsGoRemoteAndALocalPrefillIsRefusedWithTheGroupWhole) {
  const GoldenPrompt golden = goldenPrompt("tiny-bf16");
  TpCluster cluster("tiny-bf16", 0, {}, {}, {"--router.remote_prefill_min_tokens=100000"});
  ASSERT_TRUE(cluster.ready());
  const int follower = TpCluster::followerPid(cluster.leaderPid());
  ASSERT_GT(follower, 0);
  EXPECT_EQ(workerStatus(cluster.decode()).local_prefill_max_tokens, 0);
  for (int round = 0; round < 2; ++round) {
    const auto ids = cluster.complete(golden);
    ASSERT_TRUE(ids.has_value());
    EXPECT_EQ(*ids, golden.greedy) << "round " << round;
  }
  const auto metrics = scrapeMetrics(cluster.router().host(), cluster.router().port());
  ASSERT_TRUE(metrics.has_value());
  EXPECT_EQ(sampleValue(*metrics, R"(pdserve_router_prefills_total{where="remote",reason="worker_limit"})"), 2.0)
      << *metrics;
  EXPECT_EQ(sampleValue(*metrics, R"(pdserve_router_prefills_total{where="local",reason="short_prompt"})").value_or(0),
            0.0)
      << *metrics;

  // A local open straight to the worker (what an older router would send): refused, cleanly.
  worker_api::DecodeOpen open = goldenOpen(golden, "cmpl-local-on-tp");
  open.local_prompt_token_ids.assign(golden.tokens.begin(), golden.tokens.end());
  auto r = postOpen(cluster.decode(), open, 60s);
  ASSERT_TRUE(r.ok()) << r.error().toString();
  EXPECT_GE(r->status, 400) << r->body;
  EXPECT_NE(r->body.find("does not prefill locally"), std::string::npos) << r->body;

  EXPECT_TRUE(alive(follower)) << "a refused local prefill must not break the group";
  EXPECT_EQ(getStatus(cluster.decode(), "/ready"), 200);
  const auto st = workerStatus(cluster.decode());
  EXPECT_EQ(st.free_blocks, st.total_blocks) << "KV blocks leaked";
  EXPECT_EQ(st.running_requests, 0);
  const auto again = cluster.complete(golden);
  ASSERT_TRUE(again.has_value());
  EXPECT_EQ(*again, golden.greedy) << "after the refused local open";
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

// Multi-node tensor parallelism (decode.nnodes, docs/tensor-parallel.md "Across nodes"): the test
// starts one decode process per "node" on this machine, joined over TCP at a loopback rendezvous
// (the same code path as pods of a LeaderWorkerSet; only the addresses differ).
class E2eTpMultiNode : public ::testing::TestWithParam<int> {};

TEST_P(E2eTpMultiNode, GoldenTokensAcrossTwoNodesThenACleanDrain) {
  const int tp = GetParam();
  const GoldenPrompt golden = goldenPrompt("tiny-bf16");
  TpCluster cluster("tiny-bf16", 1, {}, TpLayout{tp, 2, 1});
  ASSERT_TRUE(cluster.ready());
  const int node1 = cluster.node(1).pid();
  int node1_spawned = -1;
  if (tp == 4) {
    node1_spawned = TpCluster::followerPid(node1, "--decode.tp_rank 3");
    ASSERT_GT(node1_spawned, 0) << "node 1 runs ranks 2 and 3";
    ASSERT_GT(TpCluster::followerPid(cluster.leaderPid(), "--decode.tp_rank 1"), 0) << "node 0 runs ranks 0 and 1";
  }
  for (int round = 0; round < 2; ++round) {
    const auto ids = cluster.complete(golden);
    ASSERT_TRUE(ids.has_value());
    EXPECT_EQ(*ids, golden.greedy) << "round " << round;
  }
  const auto st = workerStatus(cluster.decode());
  EXPECT_EQ(st.free_blocks, st.total_blocks) << "KV blocks leaked";
  // Node 1 answers the orchestrator's probes on its own port.
  EXPECT_EQ(getStatus(cluster.node(1), "/health"), 200);
  EXPECT_EQ(getStatus(cluster.node(1), "/ready"), 200);
  EXPECT_EQ(getStatus(cluster.node(1), "/metrics"), 200);

  // Node 1 ignores SIGTERM (the pod's is delivered to every pod of the group): it keeps serving
  // until the leader's drain is over and the leader stops the group.
  ASSERT_TRUE(cluster.node(1).signal(SIGTERM));
  std::this_thread::sleep_for(300ms);
  EXPECT_TRUE(alive(node1)) << "a node follower must outlive the leader's drain";
  const auto start = Clock::now();
  ASSERT_TRUE(cluster.decode().signal(SIGTERM));
  const auto status = cluster.decode().wait(60s);
  ASSERT_TRUE(status.has_value()) << "the TP leader did not exit";
  EXPECT_EQ(*status, 0);
  const auto node_status = cluster.node(1).wait(20s);
  ASSERT_TRUE(node_status.has_value()) << "node 1 did not exit after the leader stopped the group";
  EXPECT_EQ(*node_status, 0);
  EXPECT_LT(Clock::now() - start, 15s);
  if (node1_spawned > 0) {
    EXPECT_FALSE(alive(node1_spawned)) << "node 1's spawned rank outlived it";
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, E2eTpMultiNode, ::testing::Values(2, 4),
                         [](const auto& param_info) { return "tp" + std::to_string(param_info.param) + "_2nodes"; });

TEST(E2eTpMultiNodeFaults, ANodeThatDiesBreaksTheGroupAtOnce) {
  const GoldenPrompt golden = goldenPrompt("tiny-bf16");
  TpCluster cluster("tiny-bf16", 0, {}, TpLayout{2, 2, 1});
  ASSERT_TRUE(cluster.ready());
  ASSERT_TRUE(cluster.complete(golden).has_value());
  ASSERT_TRUE(cluster.node(1).signal(SIGKILL));
  // /ready turns 503 without traffic: the leader sees the connection drop while idle.
  EXPECT_EQ(readyWithin5s(cluster.decode()), 503) << "/ready after node 1 died";
  expectOpenFailsAtOnce(cluster.decode(), golden, "after-node-death");
  ASSERT_TRUE(cluster.decode().signal(SIGTERM));
  const auto status = cluster.decode().wait(60s);
  ASSERT_TRUE(status.has_value());
  EXPECT_EQ(*status, 0);
}

TEST(E2eTpMultiNodeFaults, TheLeaderDyingEndsTheOtherNodes) {
  TpCluster cluster("tiny-bf16", 0, {}, TpLayout{4, 2, 1});
  ASSERT_TRUE(cluster.ready());
  const int node1_spawned = TpCluster::followerPid(cluster.node(1).pid(), "--decode.tp_rank 3");
  ASSERT_GT(node1_spawned, 0);
  const auto start = Clock::now();
  ASSERT_TRUE(cluster.decode().signal(SIGKILL));
  const auto status = cluster.node(1).wait(20s);
  ASSERT_TRUE(status.has_value()) << "node 1 hangs after the leader died";
  EXPECT_EQ(*status, 1) << "a group that failed exits 1";
  EXPECT_LT(Clock::now() - start, 10s);
  const auto gone = Clock::now() + 5s;
  while (alive(node1_spawned) && Clock::now() < gone) std::this_thread::sleep_for(50ms);
  EXPECT_FALSE(alive(node1_spawned)) << "node 1's spawned rank outlived the group";
}

// Prefill tensor parallelism (prefill.tensor_parallel): rank 0 streams the KV of a forward that
// runs sharded over two processes; the decode side (TP 1) must get the golden cache and tokens.
TEST(E2eTpPrefill, GoldenTokensThroughATwoRankPrefillWorkerAndItsFaults) {
  const GoldenPrompt golden = goldenPrompt("tiny-bf16");
  TpCluster cluster("tiny-bf16", 1, {}, TpLayout{1, 1, 2});
  ASSERT_TRUE(cluster.ready());
  const int rank1 = TpCluster::followerPid(cluster.prefill().pid(), "--prefill.tp_rank 1");
  ASSERT_GT(rank1, 0);
  for (int round = 0; round < 2; ++round) {
    const auto ids = cluster.complete(golden);
    ASSERT_TRUE(ids.has_value());
    EXPECT_EQ(*ids, golden.greedy) << "round " << round;
  }
  EXPECT_EQ(getStatus(cluster.prefill(), "/ready"), 200);
  ASSERT_EQ(::kill(rank1, SIGKILL), 0);
  EXPECT_EQ(readyWithin5s(cluster.prefill()), 503) << "/ready after the prefill's rank 1 died";
  // The router takes it out of rotation: a request now fails cleanly (no prefill worker left),
  // it does not hang.
  const auto start = Clock::now();
  http::Client client(cluster.router().host(), cluster.router().port());
  http::ClientRequest req;
  req.method = "POST";
  req.target = "/v1/completions";
  req.headers.push_back({"Content-Type", "application/json"});
  req.body = R"({"model":"pdserve-default","prompt":[11,12,13],"max_tokens":2})";
  auto r = client.send(req, 60s);
  ASSERT_TRUE(r.ok()) << r.error().toString();
  EXPECT_GE(r->status, 500) << r->body;
  EXPECT_LT(Clock::now() - start, 30s);
  ASSERT_TRUE(cluster.prefill().signal(SIGTERM));
  const auto status = cluster.prefill().wait(60s);
  ASSERT_TRUE(status.has_value());
  EXPECT_EQ(*status, 0);
}

}  // namespace
}  // namespace pd::test
