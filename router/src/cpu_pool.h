#pragma once
/// A small pool of threads for the router's CPU work: parsing request bodies (up to
/// max_body_bytes of JSON), chat templating and tokenizing. The io threads only move bytes, so a
/// burst of large prompts cannot stall /health, /metrics or the token streams of others.
///
/// Bounded: at most `max_queued` tasks wait; trySubmit() refuses more (the front end answers 503
/// with Retry-After), so memory stays bounded under overload.
///
/// Thread rules: thread-safe; trySubmit() never blocks. Tasks run on the pool's threads, in
/// order, and must not block on the io threads. stop() (from a thread outside the pool) drops the
/// tasks still queued, waits for the running ones and joins the threads; the destructor calls it.

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace pd::router {

class CpuPool {
 public:
  /// `threads` >= 1 and `max_queued` >= 1 (PD_CHECK: validated by the caller's config).
  CpuPool(int threads, std::size_t max_queued);
  CpuPool(const CpuPool&) = delete;
  CpuPool& operator=(const CpuPool&) = delete;
  CpuPool(CpuPool&&) = delete;
  CpuPool& operator=(CpuPool&&) = delete;
  ~CpuPool();

  /// Queues `task`; false (and `task` is dropped) when `max_queued` tasks wait or the pool stopped.
  [[nodiscard]] bool trySubmit(std::function<void()> task);
  /// Tasks waiting for a thread (not counting running ones).
  [[nodiscard]] std::size_t queued() const;
  void stop();

 private:
  void run();

  const std::size_t max_queued_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;  // guarded by mu_
  bool stopping_ = false;                    // guarded by mu_
  std::vector<std::thread> threads_;         // last: started after everything they read
};

}  // namespace pd::router
