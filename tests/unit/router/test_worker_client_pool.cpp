// The router's pool of keep-alive connections to workers (router/src/worker_client_pool.h)
// against a real http::Server: a pooled connection the worker closed is not used again (the next
// exchange runs on a fresh connection), and an idle one is closed by the pool's own sweep once it
// is older than the idle age (the worker sees it go; nothing lingers in CLOSE-WAIT).
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <memory>
#include <string>
#include <thread>

#include "pd/common/async_http_client.h"
#include "pd/common/http_server.h"
#include "pd/common/io_threads.h"
#include "worker_client_pool.h"

namespace pd::router {
namespace {

using namespace std::chrono_literals;

template <class Pred>
bool eventually(Pred pred, std::chrono::milliseconds timeout = 10s) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < until) {
    if (pred()) return true;
    std::this_thread::sleep_for(2ms);
  }
  return pred();
}

/// A worker stand-in that answers GET /who with the caller's address (one per connection).
std::unique_ptr<http::Server> whoServer(std::chrono::milliseconds idle_timeout) {
  http::ServerOptions o;
  o.io_threads = 1;
  o.idle_timeout = idle_timeout;
  std::vector<http::Route> routes;
  routes.push_back({"GET", "/who", [](const http::Request& r, http::Exchange ex) {
                      ex.respond(http::Response::withBody(200, "text/plain", r.remote));
                    }});
  auto s = http::Server::start(std::move(o), std::move(routes));
  EXPECT_TRUE(s.ok()) << s.error().toString();
  return std::move(s).value();
}

/// One exchange through the pool, as a leg does it: acquire, call, release. The caller's address.
std::string who(WorkerClientPool& pool, std::uint16_t port) {
  auto client = pool.acquire("127.0.0.1", port);
  std::promise<Result<http::ClientResponse>> done;
  client->send({"GET", "/who", {}, {}}, 5s, [&](Result<http::ClientResponse> r) { done.set_value(std::move(r)); });
  auto r = done.get_future().get();
  EXPECT_TRUE(r.ok()) << r.error().toString();
  if (!r.ok()) return {};
  EXPECT_EQ(r.value().status, 200);
  pool.release("127.0.0.1", port, std::move(client));
  return r.value().body;
}

TEST(WorkerClientPool, AConnectionTheWorkerClosedIsNotReused) {
  auto io = http::IoThreads::start(2, "test").value();
  auto server = whoServer(150ms);
  auto pool = WorkerClientPool::create(io->executor(), {.idle_age = std::chrono::hours(1)});
  const std::string first = who(*pool, server->port());
  EXPECT_EQ(pool->idleCount(), 1U);
  EXPECT_EQ(server->connectionCount(), 1U);
  // The worker closes the idle connection after its own idle timeout: ours is now half-closed.
  ASSERT_TRUE(eventually([&] { return server->connectionCount() == 0; }));
  const std::string second = who(*pool, server->port());
  EXPECT_FALSE(second.empty());
  EXPECT_NE(second, first) << "the exchange ran on the connection the worker had closed";
  // The fresh connection went back to the pool in its place.
  EXPECT_EQ(pool->idleCount(), 1U);
  EXPECT_EQ(who(*pool, server->port()), second);  // and it is reused while it is alive
  pool->close();
  server->stop();
  io->stop();
}

TEST(WorkerClientPool, AnIdleConnectionIsClosedByTheSweepOnceOlderThanTheIdleAge) {
  auto io = http::IoThreads::start(2, "test").value();
  auto server = whoServer(std::chrono::hours(1));  // the worker would keep it open
  auto pool = WorkerClientPool::create(io->executor(), {.idle_age = 50ms});
  const std::string first = who(*pool, server->port());
  EXPECT_FALSE(first.empty());
  // Nothing acquires again: the pool's own sweep closes it, and the worker sees it go.
  ASSERT_TRUE(eventually([&] { return pool->idleCount() == 0; }));
  ASSERT_TRUE(eventually([&] { return server->connectionCount() == 0; }));
  EXPECT_NE(who(*pool, server->port()), first);  // a new connection next time
  pool->close();
  EXPECT_EQ(pool->idleCount(), 0U);
  server->stop();
  io->stop();
}

TEST(WorkerClientPool, ACancelledClientNeverGoesBack) {
  auto io = http::IoThreads::start(1, "test").value();
  auto server = whoServer(std::chrono::hours(1));
  auto pool = WorkerClientPool::create(io->executor(), {});
  EXPECT_FALSE(who(*pool, server->port()).empty());
  auto client = pool->acquire("127.0.0.1", server->port());
  EXPECT_EQ(pool->idleCount(), 0U);
  client->cancel();
  pool->release("127.0.0.1", server->port(), std::move(client));
  EXPECT_EQ(pool->idleCount(), 0U);
  pool->close();
  server->stop();
  io->stop();
}

}  // namespace
}  // namespace pd::router
