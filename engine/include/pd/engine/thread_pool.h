#pragma once
/// A fixed pool of worker threads for the CPU kernels: one fork-join region at a time, the
/// calling thread taking part. Workers spin briefly between regions (a decode step runs hundreds
/// of short regions) and then sleep on a condition variable. A region ends when its tasks are
/// done, not when every worker has checked in, so a descheduled idle worker never delays it.
///
/// Thread rules: run()/parallelFor() from one thread at a time (the engine thread); not
/// reentrant (a task must not call run() on the same pool). Destruction joins the workers.

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace pd::model {

class ThreadPool {
 public:
  /// `num_threads` counts the caller; 0 = std::thread::hardware_concurrency().
  explicit ThreadPool(int num_threads = 0);
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;
  ~ThreadPool();

  [[nodiscard]] int size() const { return static_cast<int>(workers_.size()) + 1; }

  /// Calls fn(task) for every task in [0, num_tasks), spread over the pool (dynamic
  /// scheduling); returns when all have finished. `fn` must not throw.
  template <class Fn>
  void run(std::int64_t num_tasks, const Fn& fn) {
    if (num_tasks <= 0) return;
    if (num_tasks == 1 || workers_.empty()) {
      for (std::int64_t t = 0; t < num_tasks; ++t) fn(t);
      return;
    }
    runErased(
        num_tasks, [](const void* ctx, std::int64_t task) { (*static_cast<const Fn*>(ctx))(task); }, &fn);
  }

  /// Splits [0, n) into contiguous ranges of at least `grain` items (about four per thread)
  /// and calls fn(begin, end) for each.
  template <class Fn>
  void parallelFor(std::int64_t n, std::int64_t grain, const Fn& fn) {
    if (n <= 0) return;
    if (grain < 1) grain = 1;
    std::int64_t chunks = (n + grain - 1) / grain;
    const std::int64_t target = static_cast<std::int64_t>(size()) * 4;
    if (chunks > target) chunks = target;
    const std::int64_t per = (n + chunks - 1) / chunks;
    chunks = (n + per - 1) / per;
    run(chunks, [&](std::int64_t c) {
      const std::int64_t begin = c * per;
      const std::int64_t end = begin + per < n ? begin + per : n;
      fn(begin, end);
    });
  }

 private:
  using TaskFn = void (*)(const void* ctx, std::int64_t task);
  void runErased(std::int64_t num_tasks, TaskFn fn, const void* ctx);
  void workerLoop();
  // Claims and runs tasks of the region current in claim_ until none is left.
  void drainTasks();

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::atomic<std::uint64_t> generation_{0};  // bumped per region; workers wait on it
  std::atomic<bool> stop_{false};
  std::atomic<int> sleeping_{0};
  // The current region. claim_ packs [region tag : 24][task count : 20][next task : 20]; a task
  // is taken by a compare-exchange on it, so a worker reads fn_/ctx_ only after it has claimed a
  // task of a region that is still running (the caller rewrites them only once done_ == count).
  TaskFn fn_ = nullptr;
  const void* ctx_ = nullptr;
  std::uint64_t region_tag_ = 0;
  std::atomic<std::uint64_t> claim_{0};
  std::atomic<std::int64_t> done_{0};
};

}  // namespace pd::model
