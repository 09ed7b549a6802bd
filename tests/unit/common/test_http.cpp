#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "fakes/raw_http_peer.h"
#include "pd/common/http_client.h"
#include "pd/common/http_server.h"
#include "pd/common/probe_routes.h"

namespace {

using namespace std::chrono_literals;
using pd::fakes::RawHttpPeer;
using pd::http::addProbeRoutes;
using pd::http::Client;
using pd::http::ClientRequest;
using pd::http::Exchange;
using pd::http::Probes;
using pd::http::Request;
using pd::http::Response;
using pd::http::Route;
using pd::http::Server;
using pd::http::ServerOptions;

/// A one-shot flag a test can wait on with a deadline.
class Signal {
 public:
  void set() {
    std::lock_guard lock(mu_);
    set_ = true;
    cv_.notify_all();
  }
  bool waitFor(std::chrono::milliseconds d) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, d, [&] { return set_; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool set_ = false;
};

/// Background threads that answer later, joined by the fixture (handlers must not block).
class Workers {
 public:
  Workers() = default;
  Workers(const Workers&) = delete;
  Workers& operator=(const Workers&) = delete;
  Workers(Workers&&) = delete;
  Workers& operator=(Workers&&) = delete;
  ~Workers() { joinAll(); }
  template <class F>
  void run(F f) {
    std::lock_guard lock(mu_);
    threads_.emplace_back(std::move(f));
  }
  void joinAll() {
    std::vector<std::thread> threads;
    {
      std::lock_guard lock(mu_);
      threads.swap(threads_);
    }
    for (auto& t : threads) t.join();
  }

 private:
  std::mutex mu_;
  std::vector<std::thread> threads_;
};

Response jsonError(int status, std::string_view message) {
  return Response::withBody(status, "application/json",
                            "{\"status\":" + std::to_string(status) + ",\"message\":\"" + std::string(message) + "\"}");
}

class HttpTest : public ::testing::Test {
 protected:
  void startServer(ServerOptions options = {}) {
    options.error_responder = jsonError;
    std::vector<Route> routes;
    routes.push_back(
        {"GET", "/hello", [](Request, Exchange ex) { ex.respond(Response::withBody(200, "text/plain", "hello")); }});
    routes.push_back({"POST", "/echo", [](Request req, Exchange ex) {
                        Response r = Response::withBody(200, "application/octet-stream", std::move(req.body));
                        r.headers.push_back({"X-Query", req.query});
                        r.headers.push_back({"X-Bad", "a\r\nInjected: yes"});
                        ex.respond(std::move(r));
                      }});
    routes.push_back({"GET", "/stream", [this](Request req, Exchange ex) {
                        const int n = req.query.empty() ? 5 : std::stoi(req.query);
                        workers_.run([ex, n]() mutable {
                          ex.beginStream(200, {{"Content-Type", "text/event-stream"}});
                          for (int i = 0; i < n; ++i) {
                            ex.write("data: event " + std::to_string(i) + "\n\n");
                            std::this_thread::sleep_for(1ms);
                          }
                          ex.end();
                        });
                      }});
    routes.push_back({"GET", "/forever", [this](Request, Exchange ex) {
                        // Streams until the client goes away; records that it noticed.
                        ex.onClientGone([this] { client_gone_.set(); });
                        workers_.run([ex, this]() mutable {
                          ex.beginStream(200, {{"Content-Type", "text/plain"}});
                          for (int i = 0; i < 5000 && ex.write("line " + std::to_string(i) + "\n"); ++i) {
                            std::this_thread::sleep_for(2ms);
                          }
                          stream_stopped_.set();
                        });
                      }});
    routes.push_back({"GET", "/hold", [this](Request, Exchange ex) {
                        // Never answers on its own: keeps the exchange until the client is gone.
                        ex.onClientGone([this] { client_gone_.set(); });
                        std::lock_guard lock(held_mu_);
                        held_.push_back(ex);
                      }});
    routes.push_back({"GET", "/flood", [this](Request, Exchange ex) {
                        ex.onClientGone([this] { client_gone_.set(); });
                        workers_.run([ex, this]() mutable {
                          ex.beginStream(200, {});
                          const std::string block(64 << 10, 'x');
                          int i = 0;
                          while (i < 100000 && ex.write(block)) ++i;
                          flood_writes_ = i;
                          stream_stopped_.set();
                        });
                      }});
    routes.push_back({"GET", "/drop", [](Request, Exchange) {}});
    routes.push_back({"GET", "/throw", [](Request, Exchange) { throw std::runtime_error("boom"); }});
    auto server = Server::start(std::move(options), std::move(routes));
    ASSERT_TRUE(server.ok()) << server.error().toString();
    server_ = std::move(server).value();
    port_ = server_->port();
  }

  void TearDown() override {
    if (server_) server_->stop();
    workers_.joinAll();
    std::lock_guard lock(held_mu_);
    held_.clear();
  }

  std::unique_ptr<Server> server_;
  std::uint16_t port_ = 0;
  Workers workers_;
  Signal client_gone_;
  Signal stream_stopped_;
  std::atomic<int> flood_writes_{0};
  std::mutex held_mu_;
  std::vector<Exchange> held_;
};

TEST_F(HttpTest, BindsPortZeroAndAnswers) {
  startServer();
  EXPECT_NE(port_, 0);
  Client client("127.0.0.1", port_);
  auto r = client.send({"GET", "/hello", {}, {}}, 5s);
  ASSERT_TRUE(r.ok()) << r.error().toString();
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(r->body, "hello");
  EXPECT_EQ(r->header("content-type"), "text/plain");
  EXPECT_EQ(r->header("Server"), "pdserve");
}

TEST_F(HttpTest, KeepAliveReusesOneConnection) {
  startServer();
  Client client("127.0.0.1", port_);
  for (int i = 0; i < 5; ++i) {
    auto r = client.send({"POST", "/echo?i=" + std::to_string(i), {}, "body " + std::to_string(i)}, 5s);
    ASSERT_TRUE(r.ok()) << r.error().toString();
    EXPECT_EQ(r->body, "body " + std::to_string(i));
    EXPECT_EQ(r->header("X-Query"), "i=" + std::to_string(i));
  }
  EXPECT_EQ(server_->connectionCount(), 1u);
}

TEST_F(HttpTest, HeaderValuesCannotInjectHeaders) {
  startServer();
  Client client("127.0.0.1", port_);
  auto r = client.send({"POST", "/echo", {}, "x"}, 5s);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->header("X-Bad"), "a  Injected: yes");
  EXPECT_EQ(r->header("Injected"), "");
}

TEST_F(HttpTest, UnknownPathIs404AndWrongMethodIs405) {
  startServer();
  Client client("127.0.0.1", port_);
  auto r = client.send({"GET", "/nope", {}, {}}, 5s);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->status, 404);
  EXPECT_EQ(r->body, R"({"status":404,"message":"no such endpoint"})");
  r = client.send({"DELETE", "/echo", {}, {}}, 5s);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->status, 405);
  EXPECT_EQ(r->header("Allow"), "POST");
  // The connection is still good after errors answered by the server.
  r = client.send({"GET", "/hello", {}, {}}, 5s);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->status, 200);
}

TEST_F(HttpTest, BodyOverTheLimitIs413BeforeReadingIt) {
  ServerOptions o;
  o.max_body_bytes = 1000;
  startServer(o);
  Client client("127.0.0.1", port_);
  auto r = client.send({"POST", "/echo", {}, std::string(1000, 'a')}, 5s);
  ASSERT_TRUE(r.ok()) << r.error().toString();
  EXPECT_EQ(r->status, 200);
  r = client.send({"POST", "/echo", {}, std::string(1001, 'a')}, 5s);
  ASSERT_TRUE(r.ok()) << r.error().toString();
  EXPECT_EQ(r->status, 413);
  EXPECT_EQ(r->header("Content-Type"), "application/json");
  EXPECT_EQ(r->header("Connection"), "close");
  EXPECT_NE(r->body.find("larger than the limit"), std::string::npos);
  // A client that sends a large body anyway still reads the 413 (the server drains before closing).
  r = client.send({"POST", "/echo", {}, std::string(4 << 20, 'a')}, 5s);
  ASSERT_TRUE(r.ok()) << r.error().toString();
  EXPECT_EQ(r->status, 413);
}

TEST_F(HttpTest, ChunkedBodyOverTheLimitIs413WhileReading) {
  ServerOptions o;
  o.max_body_bytes = 100;
  startServer(o);
  RawHttpPeer peer(port_);
  ASSERT_TRUE(peer.connected());
  std::string chunk(80, 'b');
  peer.send("POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n50\r\n" + chunk + "\r\n50\r\n" +
            chunk + "\r\n0\r\n\r\n");
  const std::string reply = peer.readAll();
  EXPECT_TRUE(reply.starts_with("HTTP/1.1 413 ")) << reply;
}

TEST_F(HttpTest, ExpectContinueGets100ThenTheResponse) {
  startServer();
  RawHttpPeer peer(port_);
  peer.send("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nExpect: 100-continue\r\n\r\n");
  const std::string interim = peer.readUntil("\r\n\r\n");
  EXPECT_EQ(interim, "HTTP/1.1 100 Continue\r\n\r\n");
  peer.send("abc");
  const std::string reply = peer.readUntil("abc");
  EXPECT_TRUE(reply.starts_with("HTTP/1.1 200 OK\r\n")) << reply;
}

TEST_F(HttpTest, MalformedRequestIs400AndClosed) {
  startServer();
  RawHttpPeer peer(port_);
  peer.send("THIS IS NOT HTTP\r\n\r\n");
  bool closed = false;
  const std::string reply = peer.readAll(&closed);
  EXPECT_TRUE(reply.starts_with("HTTP/1.1 400 ")) << reply;
  EXPECT_NE(reply.find("malformed HTTP request"), std::string::npos);
  EXPECT_TRUE(closed);
}

TEST_F(HttpTest, OversizedHeadersAre431) {
  ServerOptions o;
  o.max_header_bytes = 1024;
  startServer(o);
  RawHttpPeer peer(port_);
  peer.send("GET /hello HTTP/1.1\r\nHost: x\r\nX-Big: " + std::string(2000, 'h') + "\r\n\r\n");
  const std::string reply = peer.readAll();
  EXPECT_TRUE(reply.starts_with("HTTP/1.1 431 ")) << reply;
}

TEST_F(HttpTest, SlowHeadersHitTheDeadline) {
  ServerOptions o;
  o.header_timeout = 200ms;
  startServer(o);
  RawHttpPeer peer(port_);
  peer.send("GET /hello HTTP/1.1\r\nHost: x\r\n");  // never finishes the header
  const auto t0 = std::chrono::steady_clock::now();
  bool closed = false;
  (void)peer.readAll(&closed);
  EXPECT_TRUE(closed);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 3s);
}

TEST_F(HttpTest, IdleKeepAliveConnectionsAreClosed) {
  ServerOptions o;
  o.idle_timeout = 200ms;
  startServer(o);
  RawHttpPeer peer(port_);
  peer.send("GET /hello HTTP/1.1\r\nHost: x\r\n\r\n");
  const auto t0 = std::chrono::steady_clock::now();
  bool closed = false;
  const std::string reply = peer.readAll(&closed);
  EXPECT_TRUE(reply.starts_with("HTTP/1.1 200 OK")) << reply;
  EXPECT_TRUE(closed);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 3s);
}

TEST_F(HttpTest, PipelinedRequestsAreAnsweredInOrder) {
  startServer();
  RawHttpPeer peer(port_);
  peer.send(
      "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nfirstPOST /echo HTTP/1.1\r\nHost: x\r\n"
      "Content-Length: 6\r\nConnection: close\r\n\r\nsecond");
  const std::string reply = peer.readAll();
  const auto first = reply.find("first");
  const auto second = reply.find("second");
  ASSERT_NE(first, std::string::npos) << reply;
  ASSERT_NE(second, std::string::npos) << reply;
  EXPECT_LT(first, second);
}

TEST_F(HttpTest, StreamsServerSentEvents) {
  startServer();
  Client client("127.0.0.1", port_);
  std::vector<std::string> data;
  auto r = client.streamEvents({"GET", "/stream?7", {}, {}}, 5s, [&](const pd::http::SseEvent& e) {
    data.push_back(e.data);
    return true;
  });
  ASSERT_TRUE(r.ok()) << r.error().toString();
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(r->header("Transfer-Encoding"), "chunked");
  EXPECT_TRUE(r->complete);
  ASSERT_EQ(data.size(), 7u);
  EXPECT_EQ(data.front(), "event 0");
  EXPECT_EQ(data.back(), "event 6");
  // The connection serves the next request after the stream ends.
  auto again = client.send({"GET", "/hello", {}, {}}, 5s);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->body, "hello");
  EXPECT_EQ(server_->connectionCount(), 1u);
}

TEST_F(HttpTest, Http10ClientsGetAStreamEndedByClose) {
  startServer();
  RawHttpPeer peer(port_);
  peer.send("GET /stream?2 HTTP/1.0\r\n\r\n");
  bool closed = false;
  const std::string reply = peer.readAll(&closed);
  EXPECT_TRUE(closed);
  EXPECT_EQ(reply.find("Transfer-Encoding"), std::string::npos) << reply;
  EXPECT_NE(reply.find("Connection: close"), std::string::npos) << reply;
  EXPECT_TRUE(reply.ends_with("\r\n\r\ndata: event 0\n\ndata: event 1\n\n")) << reply;
}

TEST_F(HttpTest, ClientStoppingAStreamIsNoticedByTheHandler) {
  startServer();
  Client client("127.0.0.1", port_);
  int lines = 0;
  auto r = client.streamLines({"GET", "/forever", {}, {}}, 5s, [&](std::string_view) { return ++lines < 3; });
  ASSERT_TRUE(r.ok()) << r.error().toString();
  EXPECT_FALSE(r->complete);
  EXPECT_EQ(lines, 3);
  EXPECT_TRUE(client_gone_.waitFor(5s));
  EXPECT_TRUE(stream_stopped_.waitFor(5s));  // write() returned false, so the producer stopped
}

TEST_F(HttpTest, DisconnectIsNoticedWhileNothingIsBeingWritten) {
  startServer();
  {
    RawHttpPeer peer(port_);
    peer.send("GET /hold HTTP/1.1\r\nHost: x\r\n\r\n");
    std::this_thread::sleep_for(50ms);
  }  // closes without reading anything
  EXPECT_TRUE(client_gone_.waitFor(5s));
  std::lock_guard lock(held_mu_);
  ASSERT_EQ(held_.size(), 1u);
  EXPECT_TRUE(held_[0].clientGone());
  EXPECT_FALSE(held_[0].respond(Response::withBody(200, "text/plain", "late")));
}

TEST_F(HttpTest, SlowReaderIsCutInsteadOfBufferedWithoutBound) {
  ServerOptions o;
  o.max_buffered_stream_bytes = 256 << 10;
  startServer(o);
  RawHttpPeer peer(port_);
  peer.send("GET /flood HTTP/1.1\r\nHost: x\r\n\r\n");  // and never reads
  EXPECT_TRUE(stream_stopped_.waitFor(10s));
  EXPECT_TRUE(client_gone_.waitFor(5s));
  EXPECT_LT(flood_writes_.load(), 100000);
}

TEST_F(HttpTest, AbandonedOrThrowingHandlersAnswer500) {
  startServer();
  Client client("127.0.0.1", port_);
  auto r = client.send({"GET", "/drop", {}, {}}, 5s);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->status, 500);
  r = client.send({"GET", "/throw", {}, {}}, 5s);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->status, 500);
  EXPECT_EQ(r->body.find("boom"), std::string::npos);  // no internals leak
}

TEST_F(HttpTest, ManyConcurrentClients) {
  ServerOptions o;
  o.io_threads = 4;
  startServer(o);
  std::atomic<int> ok{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 32; ++t) {
    threads.emplace_back([&, t] {
      Client client("127.0.0.1", port_);
      for (int i = 0; i < 10; ++i) {
        const std::string body = std::to_string(t) + "/" + std::to_string(i);
        auto r = client.send({"POST", "/echo", {}, body}, 10s);
        if (r.ok() && r->body == body) ++ok;
        int events = 0;
        auto s = client.streamEvents({"GET", "/stream?3", {}, {}}, 10s, [&](const pd::http::SseEvent&) {
          ++events;
          return true;
        });
        if (s.ok() && events == 3) ++ok;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(ok.load(), 32 * 10 * 2);
}

TEST_F(HttpTest, GracefulStopLetsInFlightStreamsFinish) {
  startServer();
  std::thread stopper;
  std::vector<std::string> data;
  Client client("127.0.0.1", port_);
  auto r = client.streamEvents({"GET", "/stream?50", {}, {}}, 10s, [&](const pd::http::SseEvent& e) {
    if (data.empty()) stopper = std::thread([this] { server_->stop(5s); });
    data.push_back(e.data);
    return true;
  });
  stopper.join();
  ASSERT_TRUE(r.ok()) << r.error().toString();
  EXPECT_EQ(data.size(), 50u);
  // Nothing listens any more.
  Client late("127.0.0.1", port_);
  auto refused = late.send({"GET", "/hello", {}, {}}, 2s);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.error().code, pd::ErrorCode::PeerFailed);
}

TEST_F(HttpTest, StopAfterTheDrainTimeCutsStreamsAndTellsHandlers) {
  startServer();
  std::thread reader([this] {
    Client client("127.0.0.1", port_);
    (void)client.streamLines({"GET", "/hold", {}, {}}, 10s, [](std::string_view) { return true; });
  });
  while (server_->connectionCount() == 0) std::this_thread::sleep_for(5ms);
  std::this_thread::sleep_for(50ms);
  const auto t0 = std::chrono::steady_clock::now();
  server_->stop(100ms);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 3s);
  EXPECT_TRUE(client_gone_.waitFor(1s));
  reader.join();
}

TEST_F(HttpTest, HeadIsGetWithoutTheBody) {
  startServer();
  RawHttpPeer peer(port_);
  ASSERT_TRUE(
      peer.send("HEAD /hello HTTP/1.1\r\nHost: x\r\n\r\n"
                "GET /hello HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"));
  const std::string bytes = peer.readAll();
  // Two heads, both announcing the GET body's length; the body only once, after the second.
  const auto second = bytes.find("HTTP/1.1 200", 1);
  ASSERT_EQ(bytes.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << bytes;
  ASSERT_NE(second, std::string::npos) << bytes;
  const std::string head = bytes.substr(0, second);
  EXPECT_NE(head.find("Content-Length: 5\r\n"), std::string::npos) << head;
  EXPECT_EQ(head.substr(head.size() - 4), "\r\n\r\n") << head;  // no body bytes follow the head
  EXPECT_EQ(bytes.find("hello"), bytes.size() - 5) << bytes;
  // HEAD where only POST is served stays 405, and the Allow header offers HEAD beside GET.
  Client client("127.0.0.1", port_);
  auto r = client.send({"DELETE", "/hello", {}, {}}, 5s);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->status, 405);
  EXPECT_EQ(r->header("Allow"), "GET, HEAD");
  RawHttpPeer post_only(port_);
  ASSERT_TRUE(post_only.send("HEAD /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"));
  EXPECT_EQ(post_only.readAll().rfind("HTTP/1.1 405", 0), 0u);
}

namespace fdlimit {

std::size_t openFds() {
  std::size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

std::size_t countLines(const std::string& path, std::string_view needle) {
  std::ifstream in(path);
  std::size_t n = 0;
  for (std::string line; std::getline(in, line);) n += line.find(needle) != std::string::npos ? 1 : 0;
  return n;
}

/// Runs in a child process (it lowers the fd limit for good). Exit code 0 on success, else the
/// number of the check that failed.
int scenario() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_max < 256) return 0;  // nothing to test
  // 1. A lowered soft limit is raised to the hard one when a server starts.
  limit.rlim_cur = 64;
  if (setrlimit(RLIMIT_NOFILE, &limit) != 0) return 1;
  ServerOptions options;
  options.io_threads = 2;
  std::vector<Route> routes;
  routes.push_back(
      {"GET", "/hello", [](Request, Exchange ex) { ex.respond(Response::withBody(200, "text/plain", "hello")); }});
  auto server = Server::start(options, std::move(routes));
  if (!server.ok()) return 2;
  rlimit now{};
  if (getrlimit(RLIMIT_NOFILE, &now) != 0 || now.rlim_cur != limit.rlim_max) return 3;
  // 2. At the limit, the accept loop pauses instead of spinning: count its log lines.
  const std::string log_path = "/tmp/pd_test_http_fdlimit_" + std::to_string(getpid()) + ".log";
  const int log_fd = ::open(log_path.c_str(), O_CREAT | O_TRUNC | O_WRONLY, 0600);
  if (log_fd < 0 || ::dup2(log_fd, STDERR_FILENO) < 0) return 4;
  ::close(log_fd);
  limit.rlim_cur = openFds() + 8;
  limit.rlim_max = limit.rlim_cur;
  if (setrlimit(RLIMIT_NOFILE, &limit) != 0) return 5;
  std::vector<int> filler;
  for (int fd; (fd = ::open("/dev/null", O_RDONLY)) >= 0;) filler.push_back(fd);
  ::close(filler.back());  // room for the client's socket only
  filler.pop_back();
  RawHttpPeer peer((*server)->port());
  if (!peer.send("GET /hello HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")) return 6;
  std::this_thread::sleep_for(600ms);
  // 3. Once fds are free again, the waiting connection is served.
  for (const int fd : filler) ::close(fd);
  const std::size_t lines = countLines(log_path, "accept failed");  // (reading the log needs an fd too)
  const std::string answer = peer.readUntil("hello");
  std::remove(log_path.c_str());
  if (lines < 1 || lines > 2) return static_cast<int>(100 + std::min<std::size_t>(lines, 150));  // log lines
  if (answer.rfind("HTTP/1.1 200", 0) != 0) return 8;
  (*server)->stop();
  return 0;
}

}  // namespace fdlimit

// gcc and clang name an AddressSanitizer build differently.
#if defined(__SANITIZE_ADDRESS__)
#define PD_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define PD_TEST_ASAN 1
#endif
#endif

TEST(HttpServerFdLimit, RaisesTheSoftLimitAndPausesAcceptingAtTheLimit) {
#if defined(PD_TEST_ASAN)
  // The scenario exhausts the process's file descriptors; the sanitizer runtime opens files of its
  // own (to symbolize, to read /proc/self/maps) and, starved, ended the child with its exit code 1
  // (CI, 2026-12-02). The normal build runs the scenario.
  GTEST_SKIP() << "fd exhaustion starves the AddressSanitizer runtime; the normal build runs this";
#endif
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(std::_Exit(fdlimit::scenario()), ::testing::ExitedWithCode(0), "");
}

TEST(HttpClient, ConnectionRefusedIsPeerFailed) {
  std::uint16_t port = 0;
  {
    auto s = Server::start({}, {});
    ASSERT_TRUE(s.ok());
    port = s.value()->port();
  }  // closed again: nothing listens there now
  Client client("127.0.0.1", port);
  auto r = client.send({"GET", "/", {}, {}}, 2s);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, pd::ErrorCode::PeerFailed);
}

TEST_F(HttpTest, ClientDeadlineIsTimeout) {
  startServer();
  Client client("127.0.0.1", port_);
  const auto t0 = std::chrono::steady_clock::now();
  auto r = client.send({"GET", "/hold", {}, {}}, 200ms);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, pd::ErrorCode::Timeout);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s);
  EXPECT_TRUE(client_gone_.waitFor(5s));  // the server noticed the client giving up
}

TEST(HttpClient, UnresolvableHostIsAnError) {
  Client client("no-such-host.invalid", 80);
  auto r = client.send({"GET", "/", {}, {}}, 2s);
  ASSERT_FALSE(r.ok());
}

TEST(LineSplitter, SplitsAcrossFeedsAndStripsCarriageReturns) {
  pd::http::LineSplitter s;
  std::vector<std::string> lines;
  auto cb = [&](std::string_view l) {
    lines.emplace_back(l);
    return true;
  };
  EXPECT_TRUE(s.feed("ab", cb));
  EXPECT_TRUE(s.feed("c\r\nde\n\nf", cb));
  EXPECT_TRUE(s.finish(cb));
  EXPECT_EQ(lines, (std::vector<std::string>{"abc", "de", "", "f"}));
}

TEST(SseParser, JoinsDataLinesSkipsCommentsAndKeepsFields) {
  pd::http::SseParser p;
  std::vector<pd::http::SseEvent> events;
  auto cb = [&](const pd::http::SseEvent& e) {
    events.push_back(e);
    return true;
  };
  for (std::string_view line :
       {": keep-alive", "event: error", "id: 7", "data: {\"a\":", "data:1}", "", "", "data: x", ""}) {
    EXPECT_TRUE(p.feedLine(line, cb));
  }
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].event, "error");
  EXPECT_EQ(events[0].id, "7");
  EXPECT_EQ(events[0].data, "{\"a\":\n1}");
  EXPECT_EQ(events[1].event, "");
  EXPECT_EQ(events[1].data, "x");
}

TEST(ProbeRoutes, AnswerHealthReadyMetricsAndStatus) {
  auto reason = std::make_shared<std::string>();
  std::vector<Route> routes;
  addProbeRoutes(routes, {.not_ready = [reason] { return *reason; },
                          .metrics = [] { return std::string("pd_up 1\n"); },
                          .status = [] { return std::string(R"({"role":"test"})"); }});
  std::vector<Route> json_routes;
  addProbeRoutes(json_routes, {.format = Probes::Format::Json, .not_ready = [reason] { return *reason; }});
  ServerOptions options;
  options.host = "127.0.0.1";
  options.port = 0;
  auto text = Server::start(options, std::move(routes));
  auto json = Server::start(options, std::move(json_routes));
  ASSERT_TRUE(text.ok() && json.ok());
  Client t("127.0.0.1", (*text)->port());
  Client j("127.0.0.1", (*json)->port());
  const auto get = [](Client& c, const std::string& path) {
    auto r = c.send({"GET", path, {}, {}}, 5s);
    EXPECT_TRUE(r.ok());
    return r.ok() ? std::make_pair(r->status, r->body) : std::make_pair(0, std::string());
  };
  EXPECT_EQ(get(t, "/health"), std::make_pair(200, std::string("ok")));
  EXPECT_EQ(get(t, "/ready"), std::make_pair(200, std::string("ready")));
  EXPECT_EQ(get(t, "/metrics"), std::make_pair(200, std::string("pd_up 1\n")));
  EXPECT_EQ(get(t, "/v1/internal/status"), std::make_pair(200, std::string(R"({"role":"test"})")));
  EXPECT_EQ(get(j, "/health"), std::make_pair(200, std::string(R"({"status":"ok"})")));
  EXPECT_EQ(get(j, "/ready"), std::make_pair(200, std::string(R"({"status":"ready"})")));
  EXPECT_EQ(get(j, "/metrics").first, 404) << "no metrics callback, no route";
  *reason = "draining \"now\"";
  EXPECT_EQ(get(t, "/ready"), std::make_pair(503, std::string("draining \"now\"")));
  EXPECT_EQ(get(j, "/ready"), std::make_pair(503, std::string(R"({"status":"draining \"now\""})")));
  (*text)->stop();
  (*json)->stop();
}

}  // namespace
