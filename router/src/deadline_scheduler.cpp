#include "deadline_scheduler.h"

#include "pd/common/check.h"
#include "pd/common/log.h"

namespace pd::router {

DeadlineScheduler::DeadlineScheduler() : thread_([this] { run(); }) {}

DeadlineScheduler::~DeadlineScheduler() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
    pending_.clear();
    when_.clear();
  }
  cv_.notify_all();
  PD_CHECK_MSG(thread_.get_id() != std::this_thread::get_id(), "DeadlineScheduler destroyed by its own callback");
  try {
    thread_.join();
  } catch (const std::exception& e) {
    log::error("router", "joining the deadline thread failed: {}", e.what());
  }
}

DeadlineScheduler::Id DeadlineScheduler::schedule(Clock::time_point when, std::function<void()> fn) {
  std::lock_guard lock(mu_);
  const Id id = next_id_++;
  pending_.emplace(std::make_pair(when, id), std::move(fn));
  when_.emplace(id, when);
  cv_.notify_all();
  return id;
}

void DeadlineScheduler::cancel(Id id) {
  std::lock_guard lock(mu_);
  const auto it = when_.find(id);
  if (it == when_.end()) return;
  pending_.erase({it->second, id});
  when_.erase(it);
}

void DeadlineScheduler::run() {
  std::unique_lock lock(mu_);
  while (!stopping_) {
    if (pending_.empty()) {
      cv_.wait(lock);
      continue;
    }
    const auto next = pending_.begin();
    const Clock::time_point due = next->first.first;  // a copy: the entry may go while we wait
    if (Clock::now() < due) {
      cv_.wait_until(lock, due);
      continue;
    }
    std::function<void()> fn = std::move(next->second);
    when_.erase(next->first.second);
    pending_.erase(next);
    lock.unlock();
    fn();
    fn = nullptr;  // drop captured state before taking the lock again
    lock.lock();
  }
}

}  // namespace pd::router
