#pragma once
/// Runs callbacks at deadlines on one background thread: the router's per-request timeouts
/// (every wait has a deadline, even when a backend never answers).
/// Thread rules: thread-safe. Callbacks run on the scheduler's thread, one at a time, without
/// the scheduler's lock held; they must be short and must not call cancel() on themselves.

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>

namespace pd::router {

class DeadlineScheduler {
 public:
  using Clock = std::chrono::steady_clock;
  using Id = std::uint64_t;

  DeadlineScheduler();
  DeadlineScheduler(const DeadlineScheduler&) = delete;
  DeadlineScheduler& operator=(const DeadlineScheduler&) = delete;
  DeadlineScheduler(DeadlineScheduler&&) = delete;
  DeadlineScheduler& operator=(DeadlineScheduler&&) = delete;
  /// Drops pending callbacks and joins the thread. Must not run on the scheduler's own thread
  /// (so callbacks must not hold the last reference to it).
  ~DeadlineScheduler();

  /// Runs `fn` at `when` (at once if it has passed) unless cancelled first.
  Id schedule(Clock::time_point when, std::function<void()> fn);
  /// Forgets a pending callback; no effect once it has run.
  void cancel(Id id);

 private:
  void run();

  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::pair<Clock::time_point, Id>, std::function<void()>> pending_;
  std::unordered_map<Id, Clock::time_point> when_;
  Id next_id_ = 1;
  bool stopping_ = false;
  std::thread thread_;  // last: starts after everything it reads
};

}  // namespace pd::router
