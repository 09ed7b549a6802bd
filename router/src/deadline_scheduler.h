#pragma once
/// Runs callbacks at deadlines on the router's io_context: one asio steady_timer per deadline,
/// each on its own strand. With the legs' timers in pd_backend.cpp it is the router's one
/// deadline mechanism (every wait has a deadline, even when a backend never answers); there is
/// no scheduler thread.
///
/// Thread rules: thread-safe. Callbacks run on an io thread without the scheduler's lock held,
/// at most once each, never after cancel() of their id returned; they must not block. The
/// io_context must keep running while callbacks are pending, and must outlive the scheduler or
/// its close(): after close() returns the scheduler touches no timer and posts nothing, so the
/// io_context may be destroyed even while other threads still hold and call the scheduler.

#include <boost/asio/any_io_executor.hpp>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>

namespace pd::router {

class DeadlineScheduler {
 public:
  using Clock = std::chrono::steady_clock;
  using Id = std::uint64_t;

  explicit DeadlineScheduler(boost::asio::any_io_executor executor);
  DeadlineScheduler(const DeadlineScheduler&) = delete;
  DeadlineScheduler& operator=(const DeadlineScheduler&) = delete;
  DeadlineScheduler(DeadlineScheduler&&) = delete;
  DeadlineScheduler& operator=(DeadlineScheduler&&) = delete;
  /// Cancels every pending callback.
  ~DeadlineScheduler();

  /// Cancels every pending callback; later schedule() calls return 0 and run nothing, later
  /// cancel() calls do nothing. Idempotent.
  void close() noexcept;

  /// Runs `fn` at `when` (soon, if it has passed) unless cancelled first; 0 once closed.
  Id schedule(Clock::time_point when, std::function<void()> fn);
  /// Forgets a pending callback; no effect once it has begun.
  void cancel(Id id);
  /// Callbacks scheduled and neither run nor cancelled (for tests).
  [[nodiscard]] std::size_t pending() const;

  struct State;

 private:
  std::shared_ptr<State> state_;  // shared with the timers' handlers, which may outlive this
};

}  // namespace pd::router
