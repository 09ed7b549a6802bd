#include "worker_client_pool.h"

#include <fmt/format.h>

#include <algorithm>
#include <exception>
#include <utility>

#include "pd/common/log.h"

namespace pd::router {

namespace {
std::string keyOf(const std::string& host, std::uint16_t port) {
  return fmt::format("{}:{}", host, port);
}
}  // namespace

std::shared_ptr<WorkerClientPool> WorkerClientPool::create(boost::asio::any_io_executor executor,
                                                           WorkerClientPoolOptions options) {
  std::shared_ptr<WorkerClientPool> pool(new WorkerClientPool(std::move(executor), options));
  pool->scheduleSweep();
  return pool;
}

WorkerClientPool::WorkerClientPool(boost::asio::any_io_executor executor, WorkerClientPoolOptions options)
    : executor_(std::move(executor)), options_(options), sweep_(executor_) {}

WorkerClientPool::~WorkerClientPool() {
  try {
    close();
  } catch (const std::exception& e) {
    log::error("router", "closing the worker connection pool failed: {}", e.what());
  }
}

std::unique_ptr<http::AsyncClient> WorkerClientPool::acquire(const std::string& host, std::uint16_t port) {
  std::unique_ptr<http::AsyncClient> stale;  // destroyed outside the lock
  {
    std::lock_guard lock(mu_);
    auto it = idle_.find(keyOf(host, port));
    const auto now = Clock::now();
    while (it != idle_.end() && !it->second.empty()) {
      Entry e = std::move(it->second.back());
      it->second.pop_back();
      if (now - e.since < options_.idle_age && e.client->reusable()) return std::move(e.client);
      stale = std::move(e.client);
    }
  }
  return std::make_unique<http::AsyncClient>(executor_, host, port);
}

void WorkerClientPool::release(const std::string& host, std::uint16_t port, std::unique_ptr<http::AsyncClient> client) {
  if (!client || client->cancelled() || !client->reusable()) return;
  std::lock_guard lock(mu_);
  if (closed_) return;
  auto& idle = idle_[keyOf(host, port)];
  if (idle.size() < options_.max_idle_per_worker) idle.push_back(Entry{std::move(client), Clock::now()});
}

std::size_t WorkerClientPool::reap() {
  std::vector<std::unique_ptr<http::AsyncClient>> old;  // closed outside the lock
  {
    std::lock_guard lock(mu_);
    const auto now = Clock::now();
    for (auto it = idle_.begin(); it != idle_.end();) {
      auto& entries = it->second;
      // Oldest first: the expired ones are a prefix.
      const auto fresh = std::find_if(entries.begin(), entries.end(),
                                      [&](const Entry& e) { return now - e.since < options_.idle_age; });
      for (auto e = entries.begin(); e != fresh; ++e) old.push_back(std::move(e->client));
      entries.erase(entries.begin(), fresh);
      it = entries.empty() ? idle_.erase(it) : std::next(it);
    }
  }
  return old.size();  // each AsyncClient closes its connection as it is destroyed here
}

std::size_t WorkerClientPool::idleCount() const {
  std::lock_guard lock(mu_);
  std::size_t n = 0;
  for (const auto& [key, entries] : idle_) n += entries.size();
  return n;
}

void WorkerClientPool::close() {
  std::map<std::string, std::vector<Entry>> all;
  {
    std::lock_guard lock(mu_);
    if (closed_) return;
    closed_ = true;
    sweep_.cancel();
    all.swap(idle_);
  }
}

void WorkerClientPool::scheduleSweep() {
  const auto period = std::clamp<std::chrono::milliseconds>(options_.idle_age / 4, std::chrono::milliseconds{1},
                                                            std::chrono::seconds{1});
  std::lock_guard lock(mu_);
  if (closed_) return;
  sweep_.expires_after(period);
  sweep_.async_wait([weak = weak_from_this()](const boost::system::error_code& ec) {
    if (ec) return;
    if (auto pool = weak.lock()) {
      pool->reap();
      pool->scheduleSweep();
    }
  });
}

}  // namespace pd::router
