// The CUDA DeviceCopier: cudaMemcpyAsync on a stream of its own, an event recorded behind each
// copy, and one completion thread that waits for the events in submission order.
#include <fmt/format.h>

#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "pd/common/log.h"
#include "pd/cuda/cuda_check.h"
#include "pd/cuda/cuda_handles.h"
#include "pd/kvtransfer/device_copier.h"

namespace pd::kvtransfer {
namespace {

class CudaCopier final : public DeviceCopier {
 public:
  CudaCopier(int device, cuda::Stream stream)
      : device_(device), stream_(std::move(stream)), thread_([this] { run(); }) {}

  ~CudaCopier() override {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    thread_.join();  // waits for every queued copy's event: a copy that was queued has started
  }

  CudaCopier(const CudaCopier&) = delete;
  CudaCopier& operator=(const CudaCopier&) = delete;
  CudaCopier(CudaCopier&&) = delete;
  CudaCopier& operator=(CudaCopier&&) = delete;

  [[nodiscard]] std::string name() const override { return "cuda"; }

  Result<StagingMemory> allocateHost(std::size_t bytes) override {
    PD_CUDA_TRY(cudaSetDevice(device_));
    void* ptr = nullptr;
    const Status s = PD_CUDA_STATUS(cudaMallocHost(&ptr, bytes == 0 ? 1 : bytes));
    if (!s.ok()) return makeError(ErrorCode::ResourceExhausted, s.error().message);
    std::memset(ptr, 0, bytes);
    return StagingMemory(static_cast<std::byte*>(ptr), bytes, [](std::byte* p) noexcept {
      const Status freed = PD_CUDA_STATUS(cudaFreeHost(p));
      if (!freed.ok()) log::warn("kvtransfer", "{}", freed.error().toString());
    });
  }

  // cudaMemcpyDefault: the runtime tells device from host memory by address (unified addressing),
  // so a pool that is really host memory still copies correctly.
  Status copy(CopyDirection /*direction*/, std::vector<CopySpan> spans, CopyDoneFn on_done) override {
    std::lock_guard lock(mutex_);  // one submitter at a time keeps the queue in stream order
    if (stopping_) return makeError(ErrorCode::Cancelled, "CUDA copier shut down");
    PD_CUDA_TRY(cudaSetDevice(device_));
    PD_ASSIGN_OR_RETURN(cuda::Event event, cuda::Event::create());
    for (const CopySpan& span : spans) {
      PD_CUDA_TRY(cudaMemcpyAsync(span.dst, span.src, span.bytes, cudaMemcpyDefault, stream_.get()));
    }
    PD_TRY(event.record(stream_));
    queue_.push_back(Job{std::move(event), std::move(on_done)});
    wake_.notify_one();
    return okStatus();
  }

 private:
  struct Job {
    cuda::Event event;
    CopyDoneFn on_done;
  };

  void run() {
    if (const Status s = PD_CUDA_STATUS(cudaSetDevice(device_)); !s.ok()) {
      log::warn("kvtransfer", "CUDA copier thread: {}", s.error().toString());
    }
    std::unique_lock lock(mutex_);
    for (;;) {
      wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      Job job = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      Status done = job.event.synchronize();
      job.on_done(std::move(done));
      lock.lock();
    }
  }

  const int device_;
  cuda::Stream stream_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Job> queue_;  // guarded by mutex_
  bool stopping_ = false;  // guarded by mutex_
  std::thread thread_;     // last: starts after the members it uses
};

}  // namespace

Result<std::unique_ptr<DeviceCopier>> createCudaCopier(int device) {
  if (cuda::deviceCount() == 0) return makeError(ErrorCode::Unsupported, "no CUDA device for the KV staging copier");
  if (device < 0) {
    PD_CUDA_TRY(cudaGetDevice(&device));
  } else {
    if (device >= cuda::deviceCount()) {
      return makeError(ErrorCode::InvalidArgument, "KV staging copier: no CUDA device " + std::to_string(device));
    }
    PD_CUDA_TRY(cudaSetDevice(device));  // the stream below is created on it
  }
  PD_ASSIGN_OR_RETURN(cuda::Stream stream, cuda::Stream::create());
  return std::unique_ptr<DeviceCopier>(std::make_unique<CudaCopier>(device, std::move(stream)));
}

}  // namespace pd::kvtransfer
