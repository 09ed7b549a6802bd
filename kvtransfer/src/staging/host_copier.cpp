// The host DeviceCopier: memcpy on one worker thread, which also runs the callbacks.
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <new>
#include <thread>

#include "pd/kvtransfer/device_copier.h"

namespace pd::kvtransfer {
namespace {

class HostCopier final : public DeviceCopier {
 public:
  HostCopier() : thread_([this] { run(); }) {}

  ~HostCopier() override {
    std::deque<Job> cancelled;
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
      cancelled.swap(queue_);
    }
    wake_.notify_all();
    thread_.join();
    for (auto& job : cancelled) job.on_done(makeError(ErrorCode::Cancelled, "host copier shut down"));
  }

  HostCopier(const HostCopier&) = delete;
  HostCopier& operator=(const HostCopier&) = delete;
  HostCopier(HostCopier&&) = delete;
  HostCopier& operator=(HostCopier&&) = delete;

  [[nodiscard]] std::string name() const override { return "host"; }

  Result<StagingMemory> allocateHost(std::size_t bytes) override {
    auto* data = new (std::nothrow) std::byte[bytes == 0 ? 1 : bytes]();
    if (data == nullptr) return makeError(ErrorCode::ResourceExhausted, "staging memory: out of host memory");
    return StagingMemory(data, bytes, [](std::byte* p) noexcept { delete[] p; });
  }

  Status copy(CopyDirection /*direction*/, std::vector<CopySpan> spans, CopyDoneFn on_done) override {
    {
      std::lock_guard lock(mutex_);
      if (stopping_) return makeError(ErrorCode::Cancelled, "host copier shut down");
      queue_.push_back(Job{std::move(spans), std::move(on_done)});
    }
    wake_.notify_one();
    return okStatus();
  }

 private:
  struct Job {
    std::vector<CopySpan> spans;
    CopyDoneFn on_done;
  };

  void run() {
    std::unique_lock lock(mutex_);
    for (;;) {
      wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, nothing left
      Job job = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      for (const CopySpan& span : job.spans) {
        if (span.bytes > 0) std::memcpy(span.dst, span.src, span.bytes);
      }
      job.on_done(okStatus());
      lock.lock();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Job> queue_;  // guarded by mutex_
  bool stopping_ = false;  // guarded by mutex_
  std::thread thread_;     // last: starts after the members it uses
};

}  // namespace

std::unique_ptr<DeviceCopier> createHostCopier() {
  return std::make_unique<HostCopier>();
}

}  // namespace pd::kvtransfer
