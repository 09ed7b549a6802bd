#pragma once
/// Idle keep-alive connections to the workers (http::AsyncClient), reused by later legs so that a
/// leg costs no TCP connect. A client goes back only after an exchange that left its connection
/// open and reusable (AsyncClient::reusable(): never one that was cancelled or cut).
///
/// Idle reaping: a client idle for `idle_age` is closed, by a timer on the io_context that sweeps
/// every `idle_age / 4` (at most once a second) and on acquire(). `idle_age` defaults a few
/// seconds below the workers' own idle timeout (60 s), so the worker never closes a pooled
/// connection first and nothing lingers in CLOSE-WAIT here. A worker that closes one anyway (a
/// restart) costs nothing either: an exchange on a reused connection that fails before any
/// response byte is retried once on a fresh connection by AsyncClient.
///
/// Thread rules: thread-safe. Clients are created on the pool's executor. close() (or the last
/// owner's reference going away) stops the sweeps and drops the idle clients.

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/steady_timer.hpp>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "pd/common/async_http_client.h"

namespace pd::router {

struct WorkerClientPoolOptions {
  std::chrono::milliseconds idle_age{55000};
  std::size_t max_idle_per_worker = 256;
};

class WorkerClientPool : public std::enable_shared_from_this<WorkerClientPool> {
 public:
  using Clock = std::chrono::steady_clock;

  /// Starts the sweeps. shared: the sweep timer's handler holds the pool weakly.
  [[nodiscard]] static std::shared_ptr<WorkerClientPool> create(boost::asio::any_io_executor executor,
                                                                WorkerClientPoolOptions options);
  WorkerClientPool(const WorkerClientPool&) = delete;
  WorkerClientPool& operator=(const WorkerClientPool&) = delete;
  WorkerClientPool(WorkerClientPool&&) = delete;
  WorkerClientPool& operator=(WorkerClientPool&&) = delete;
  ~WorkerClientPool();

  /// An idle client to host:port younger than idle_age, or a new one (which connects lazily).
  [[nodiscard]] std::unique_ptr<http::AsyncClient> acquire(const std::string& host, std::uint16_t port);
  /// Parks `client` for reuse when it is reusable (and the pool not closed); drops it otherwise.
  void release(const std::string& host, std::uint16_t port, std::unique_ptr<http::AsyncClient> client);
  /// Closes the idle clients older than idle_age now; returns how many.
  std::size_t reap();
  /// Idle clients parked right now.
  [[nodiscard]] std::size_t idleCount() const;
  /// Stops the sweeps and closes every idle client. Idempotent.
  void close();

 private:
  WorkerClientPool(boost::asio::any_io_executor executor, WorkerClientPoolOptions options);
  void scheduleSweep();

  struct Entry {
    std::unique_ptr<http::AsyncClient> client;
    Clock::time_point since;
  };

  const boost::asio::any_io_executor executor_;
  const WorkerClientPoolOptions options_;
  mutable std::mutex mu_;
  std::map<std::string, std::vector<Entry>> idle_;  // guarded by mu_: by "host:port", oldest first
  boost::asio::steady_timer sweep_;                 // guarded by mu_
  bool closed_ = false;                             // guarded by mu_
};

}  // namespace pd::router
