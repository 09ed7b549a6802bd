#include "cpu_pool.h"

#include <exception>
#include <utility>

#include "pd/common/check.h"
#include "pd/common/log.h"

namespace pd::router {

CpuPool::CpuPool(int threads, std::size_t max_queued) : max_queued_(max_queued) {
  PD_CHECK_MSG(threads >= 1 && max_queued >= 1, "CpuPool needs a thread and a queue slot");
  threads_.reserve(static_cast<std::size_t>(threads));
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { run(); });
}

CpuPool::~CpuPool() {
  stop();
}

bool CpuPool::trySubmit(std::function<void()> task) {
  {
    std::lock_guard lock(mu_);
    if (stopping_ || queue_.size() >= max_queued_) return false;
    queue_.push_back(std::move(task));
  }
  cv_.notify_one();
  return true;
}

std::size_t CpuPool::queued() const {
  std::lock_guard lock(mu_);
  return queue_.size();
}

void CpuPool::stop() {
  std::deque<std::function<void()>> dropped;  // destroyed outside the lock
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
    dropped.swap(queue_);
  }
  cv_.notify_all();
  for (auto& t : threads_) {
    if (t.joinable()) t.join();
  }
}

void CpuPool::run() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (stopping_) return;
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    try {
      task();
    } catch (const std::exception& e) {
      log::error("router", "a CPU task failed: {}", e.what());
    }
  }
}

}  // namespace pd::router
