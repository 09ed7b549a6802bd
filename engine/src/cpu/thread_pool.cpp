#include "pd/engine/thread_pool.h"

#include <chrono>

#include "pd/common/check.h"

namespace pd::model {
namespace {

inline void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

// How long an idle worker spins before it sleeps: longer than the gap between two kernels of a
// decode step, short enough not to burn a core when the engine is idle.
constexpr auto kSpinBeforeSleep = std::chrono::microseconds(300);

constexpr std::uint64_t kFieldBits = 20;
constexpr std::uint64_t kFieldMask = (std::uint64_t{1} << kFieldBits) - 1;
constexpr std::uint64_t kTagMask = (std::uint64_t{1} << 24) - 1;

constexpr std::uint64_t packClaim(std::uint64_t tag, std::uint64_t count, std::uint64_t next) {
  return (tag << (2 * kFieldBits)) | (count << kFieldBits) | next;
}

}  // namespace

ThreadPool::ThreadPool(int num_threads) {
  if (num_threads <= 0) {
    num_threads = static_cast<int>(std::thread::hardware_concurrency());
    if (num_threads <= 0) num_threads = 1;
  }
  workers_.reserve(static_cast<std::size_t>(num_threads - 1));
  for (int i = 1; i < num_threads; ++i) workers_.emplace_back([this] { workerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_.store(true);
  }
  wake_.notify_all();
  for (auto& w : workers_) w.join();
}

void ThreadPool::drainTasks() {
  std::uint64_t c = claim_.load(std::memory_order_acquire);
  for (;;) {
    const std::uint64_t next = c & kFieldMask;
    const std::uint64_t count = (c >> kFieldBits) & kFieldMask;
    if (next >= count) return;
    if (claim_.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
      fn_(ctx_, static_cast<std::int64_t>(next));
      done_.fetch_add(1, std::memory_order_release);
      c = claim_.load(std::memory_order_acquire);
    }
  }
}

void ThreadPool::runErased(std::int64_t num_tasks, TaskFn fn, const void* ctx) {
  PD_CHECK(num_tasks > 0 && static_cast<std::uint64_t>(num_tasks) <= kFieldMask);
  fn_ = fn;
  ctx_ = ctx;
  done_.store(0, std::memory_order_relaxed);
  region_tag_ = (region_tag_ + 1) & kTagMask;
  claim_.store(packClaim(region_tag_, static_cast<std::uint64_t>(num_tasks), 0), std::memory_order_release);
  generation_.fetch_add(1, std::memory_order_seq_cst);
  if (sleeping_.load(std::memory_order_seq_cst) > 0) {
    std::lock_guard<std::mutex> lock(mutex_);
    wake_.notify_all();
  }
  drainTasks();
  std::uint32_t spins = 0;
  while (done_.load(std::memory_order_acquire) != num_tasks) {
    if (++spins < 4096) {
      cpuRelax();
    } else {
      std::this_thread::yield();
    }
  }
}

void ThreadPool::workerLoop() {
  std::uint64_t seen = 0;
  for (;;) {
    auto spin_start = std::chrono::steady_clock::now();
    std::uint32_t spins = 0;
    std::uint64_t gen = generation_.load(std::memory_order_acquire);
    while (gen == seen && !stop_.load(std::memory_order_relaxed)) {
      cpuRelax();
      if ((++spins & 255U) == 0 && std::chrono::steady_clock::now() - spin_start > kSpinBeforeSleep) {
        std::unique_lock<std::mutex> lock(mutex_);
        sleeping_.fetch_add(1, std::memory_order_seq_cst);
        wake_.wait(lock, [&] {
          return generation_.load(std::memory_order_seq_cst) != seen || stop_.load(std::memory_order_relaxed);
        });
        sleeping_.fetch_sub(1, std::memory_order_seq_cst);
        spin_start = std::chrono::steady_clock::now();
      }
      gen = generation_.load(std::memory_order_acquire);
    }
    if (stop_.load(std::memory_order_relaxed)) return;
    seen = gen;
    drainTasks();
  }
}

}  // namespace pd::model
