#include "deadline_scheduler.h"

#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <exception>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "pd/common/log.h"

namespace pd::router {

namespace net = boost::asio;

namespace {
/// One deadline: its timer (touched on its strand only) and its callback.
struct Pending {
  explicit Pending(const net::any_io_executor& executor) : timer(net::make_strand(executor)) {}
  net::steady_timer timer;
  std::function<void()> fn;
};
}  // namespace

struct DeadlineScheduler::State {
  explicit State(net::any_io_executor e) : executor(std::move(e)) {}
  const net::any_io_executor executor;
  std::mutex mu;
  std::unordered_map<Id, std::shared_ptr<Pending>> pending;  // guarded by mu
  Id next_id = 1;                                            // guarded by mu
  bool closed = false;                                       // guarded by mu

  /// Whoever takes the entry out of `pending` decides: the timer (runs it) or cancel (drops it).
  void fire(Id id) {
    std::function<void()> fn;
    {
      std::lock_guard lock(mu);
      auto it = pending.find(id);
      if (it == pending.end()) return;
      fn = std::move(it->second->fn);
      pending.erase(it);
    }
    fn();
  }
};

namespace {
/// Queues the timer's cancel on its strand and hands the last reference to that handler, so that
/// the timer is destroyed on an io thread or with the io_context, never after it. Called with the
/// scheduler's lock held: close() waits for it, so nothing is posted once close() has returned.
void cancelTimerLocked(std::shared_ptr<Pending> p) {
  const auto executor = p->timer.get_executor();
  net::post(executor, [p = std::move(p)] { p->timer.cancel(); });
}
}  // namespace

DeadlineScheduler::DeadlineScheduler(net::any_io_executor executor)
    : state_(std::make_shared<State>(std::move(executor))) {}

DeadlineScheduler::~DeadlineScheduler() {
  close();
}

void DeadlineScheduler::close() noexcept {
  try {
    std::lock_guard lock(state_->mu);
    if (state_->closed) return;
    state_->closed = true;
    for (auto& entry : state_->pending) cancelTimerLocked(std::move(entry.second));
    state_->pending.clear();
  } catch (const std::exception& e) {
    // A timer left armed only fires into a closed scheduler, which runs nothing.
    log::error("router", "cancelling the pending deadlines failed: {}", e.what());
  }
}

DeadlineScheduler::Id DeadlineScheduler::schedule(Clock::time_point when, std::function<void()> fn) {
  std::lock_guard lock(state_->mu);
  if (state_->closed) return 0;
  auto p = std::make_shared<Pending>(state_->executor);
  p->fn = std::move(fn);
  const Id id = state_->next_id++;
  state_->pending.emplace(id, p);
  // Armed on the timer's strand, where a later cancel() is queued behind it. Posted under the
  // lock, so that it is queued before close() returns.
  const auto executor = p->timer.get_executor();
  net::post(executor, [p = std::move(p), when, id, weak = std::weak_ptr<State>(state_)] {
    p->timer.expires_at(when);
    p->timer.async_wait([id, weak](const boost::system::error_code& ec) {
      if (ec) return;
      if (auto state = weak.lock()) state->fire(id);
    });
  });
  return id;
}

void DeadlineScheduler::cancel(Id id) {
  std::lock_guard lock(state_->mu);
  auto it = state_->pending.find(id);
  if (it == state_->pending.end()) return;
  std::shared_ptr<Pending> p = std::move(it->second);
  state_->pending.erase(it);
  cancelTimerLocked(std::move(p));
}

std::size_t DeadlineScheduler::pending() const {
  std::lock_guard lock(state_->mu);
  return state_->pending.size();
}

}  // namespace pd::router
