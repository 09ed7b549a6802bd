// http::AsyncClient (common/include/pd/common/async_http_client.h) against a real http::Server:
// whole responses over one keep-alive connection, streamed lines, an early stop, deadlines,
// cancel, a refused connection, and many exchanges on two io threads without a thread per call.
#include <gtest/gtest.h>

#include <atomic>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <chrono>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "pd/common/async_http_client.h"
#include "pd/common/http_server.h"

namespace pd::http {
namespace {

using namespace std::chrono_literals;

/// An io_context run by `n` threads for the test's clients.
class IoThreads {
 public:
  explicit IoThreads(int n) {
    for (int i = 0; i < n; ++i) threads_.emplace_back([this] { ioc_.run(); });
  }
  IoThreads(const IoThreads&) = delete;
  IoThreads& operator=(const IoThreads&) = delete;
  IoThreads(IoThreads&&) = delete;
  IoThreads& operator=(IoThreads&&) = delete;
  ~IoThreads() {
    work_.reset();
    for (auto& t : threads_) t.join();
  }
  boost::asio::any_io_executor executor() { return ioc_.get_executor(); }

 private:
  boost::asio::io_context ioc_;
  boost::asio::executor_work_guard<boost::asio::io_context::executor_type> work_{ioc_.get_executor()};
  std::vector<std::thread> threads_;
};

class AsyncClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::vector<Route> routes;
    routes.push_back(
        {"GET", "/hello", [](Request, Exchange ex) { ex.respond(Response::withBody(200, "text/plain", "hello")); }});
    routes.push_back({"POST", "/echo", [](Request r, Exchange ex) {
                        ex.respond(Response::withBody(200, "text/plain", std::move(r.body)));
                      }});
    routes.push_back({"GET", "/missing",
                      [](Request, Exchange ex) { ex.respond(Response::withBody(404, "text/plain", "not here")); }});
    routes.push_back({"GET", "/lines", [](Request, Exchange ex) {
                        ex.beginStream(200, {{"Content-Type", "application/x-ndjson"}});
                        ex.write("one\ntw");
                        ex.write("o\r\nthree");
                        ex.end();
                      }});
    routes.push_back({"GET", "/hold", [this](Request, Exchange ex) {
                        std::lock_guard lock(mu_);
                        held_.push_back(std::move(ex));  // never answered while the test runs
                      }});
    ServerOptions o;
    o.io_threads = 2;
    server_ = Server::start(o, std::move(routes)).value();
  }
  void TearDown() override {
    server_->stop();
    std::lock_guard lock(mu_);
    held_.clear();
  }

  /// Runs one exchange and waits for its `done`.
  static Result<ClientResponse> sendAndWait(AsyncClient& client, ClientRequest request,
                                            std::chrono::milliseconds timeout = 5s) {
    std::promise<Result<ClientResponse>> p;
    client.send(std::move(request), timeout, [&p](Result<ClientResponse> r) { p.set_value(std::move(r)); });
    return p.get_future().get();
  }

  IoThreads io_{2};
  std::unique_ptr<Server> server_;
  std::mutex mu_;
  std::vector<Exchange> held_;
};

TEST_F(AsyncClientTest, WholeResponsesReuseOneKeepAliveConnection) {
  AsyncClient client(io_.executor(), "127.0.0.1", server_->port());
  for (int i = 0; i < 5; ++i) {
    auto r = sendAndWait(client, {"POST", "/echo", {}, "body " + std::to_string(i)});
    ASSERT_TRUE(r.ok()) << r.error().toString();
    EXPECT_EQ(r->status, 200);
    EXPECT_EQ(r->body, "body " + std::to_string(i));
    EXPECT_TRUE(client.reusable());
  }
  EXPECT_EQ(server_->connectionCount(), 1U);
  auto missing = sendAndWait(client, {"GET", "/missing", {}, {}});
  ASSERT_TRUE(missing.ok());  // an HTTP error status is a response, not an error
  EXPECT_EQ(missing->status, 404);
  EXPECT_EQ(missing->body, "not here");
}

TEST_F(AsyncClientTest, StreamsLinesAsTheyArriveAndCanStopEarly) {
  AsyncClient client(io_.executor(), "127.0.0.1", server_->port());
  std::vector<std::string> lines;
  std::promise<Result<ClientResponse>> p;
  client.streamLines(
      {"GET", "/lines", {}, {}}, 5s,
      [&](std::string_view line) {
        lines.emplace_back(line);
        return true;
      },
      [&](Result<ClientResponse> r) { p.set_value(std::move(r)); });
  auto r = p.get_future().get();
  ASSERT_TRUE(r.ok()) << r.error().toString();
  EXPECT_TRUE(r->complete);
  EXPECT_EQ(lines, (std::vector<std::string>{"one", "two", "three"}));

  std::promise<Result<ClientResponse>> stopped;
  int seen = 0;
  client.streamLines(
      {"GET", "/lines", {}, {}}, 5s,
      [&](std::string_view) {
        ++seen;
        return false;
      },
      [&](Result<ClientResponse> res) { stopped.set_value(std::move(res)); });
  auto s = stopped.get_future().get();
  ASSERT_TRUE(s.ok());
  EXPECT_FALSE(s->complete);
  EXPECT_EQ(seen, 1);
  EXPECT_FALSE(client.reusable());                              // the unread rest of the stream closed the connection
  auto again = sendAndWait(client, {"GET", "/hello", {}, {}});  // reconnects
  ASSERT_TRUE(again.ok()) << again.error().toString();
  EXPECT_EQ(again->body, "hello");
}

TEST_F(AsyncClientTest, DeadlineIsTimeoutAndCancelIsCancelled) {
  AsyncClient slow(io_.executor(), "127.0.0.1", server_->port());
  const auto t0 = std::chrono::steady_clock::now();
  auto r = sendAndWait(slow, {"GET", "/hold", {}, {}}, 200ms);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, ErrorCode::Timeout);
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 200ms);

  AsyncClient client(io_.executor(), "127.0.0.1", server_->port());
  std::promise<Result<ClientResponse>> p;
  client.send({"GET", "/hold", {}, {}}, 30s, [&](Result<ClientResponse> res) { p.set_value(std::move(res)); });
  auto f = p.get_future();
  EXPECT_EQ(f.wait_for(100ms), std::future_status::timeout);
  client.cancel();
  ASSERT_EQ(f.wait_for(5s), std::future_status::ready);
  auto c = f.get();
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.error().code, ErrorCode::Cancelled);
  EXPECT_TRUE(client.cancelled());
  auto later = sendAndWait(client, {"GET", "/hello", {}, {}});
  ASSERT_FALSE(later.ok());
  EXPECT_EQ(later.error().code, ErrorCode::Cancelled);
}

TEST_F(AsyncClientTest, DestroyingTheClientEndsItsExchangeWithCancelled) {
  std::promise<Result<ClientResponse>> p;
  {
    AsyncClient client(io_.executor(), "127.0.0.1", server_->port());
    client.send({"GET", "/hold", {}, {}}, 30s, [&](Result<ClientResponse> res) { p.set_value(std::move(res)); });
  }
  auto f = p.get_future();
  ASSERT_EQ(f.wait_for(5s), std::future_status::ready);
  auto r = f.get();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, ErrorCode::Cancelled);
}

TEST(AsyncClient, ConnectionRefusedIsPeerFailed) {
  std::uint16_t port = 0;
  {
    auto s = Server::start({}, {});
    ASSERT_TRUE(s.ok());
    port = s.value()->port();
  }  // closed again: nothing listens there now
  IoThreads io(1);
  AsyncClient client(io.executor(), "127.0.0.1", port);
  std::promise<Result<ClientResponse>> p;
  client.send({"GET", "/", {}, {}}, 2s, [&](Result<ClientResponse> r) { p.set_value(std::move(r)); });
  auto r = p.get_future().get();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, ErrorCode::PeerFailed);
}

TEST_F(AsyncClientTest, ManyConcurrentExchangesOnTwoIoThreads) {
  // 200 clients, each with 5 exchanges in a row, all driven by the two io threads above.
  constexpr int kClients = 200;
  constexpr int kRounds = 5;
  std::vector<std::unique_ptr<AsyncClient>> clients;
  std::atomic<int> ok{0};
  std::atomic<int> finished{0};
  // Callbacks that may still run: raised before each send, lowered as a callback's last act. The
  // test ends only when it is 0, so no io thread is still inside a callback (or in the send it
  // made) when the clients and these counters go away.
  std::atomic<int> active{0};
  std::function<void(int, int)> next = [&](int c, int round) {
    ++active;
    clients[static_cast<std::size_t>(c)]->send({"POST", "/echo", {}, std::to_string(c)}, 10s,
                                               [&, c, round](Result<ClientResponse> r) {
                                                 const bool good = r.ok() && r->body == std::to_string(c);
                                                 if (good && round + 1 < kRounds) {
                                                   next(c, round + 1);
                                                 } else {
                                                   ok += good ? 1 : 0;
                                                   ++finished;
                                                 }
                                                 --active;
                                               });
  };
  for (int c = 0; c < kClients; ++c)
    clients.push_back(std::make_unique<AsyncClient>(io_.executor(), "127.0.0.1", server_->port()));
  for (int c = 0; c < kClients; ++c) next(c, 0);
  const auto until = std::chrono::steady_clock::now() + 30s;
  while ((finished.load() < kClients || active.load() != 0) && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(1ms);  // a wait for the condition, not for time to pass
  }
  ASSERT_EQ(finished.load(), kClients);
  ASSERT_EQ(active.load(), 0);
  EXPECT_EQ(ok.load(), kClients);
}

}  // namespace
}  // namespace pd::http
