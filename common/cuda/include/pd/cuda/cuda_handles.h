#pragma once
/// Move-only RAII owners of CUDA runtime and cuBLAS handles. Each is acquired by a static
/// create() that returns a Result (every call checked by PD_CUDA_STATUS) and released in its
/// destructor, which logs a failure and never throws. An owner that depends on another (a
/// BlasHandle on its Stream) must be destroyed first: declare it after what it depends on.
/// Owners free on the device that is current when they die; a class holding owners for a
/// device other than 0 makes that device current before its members are destroyed.
///
/// Thread rules: an owner belongs to one thread at a time; a Stream orders the work queued on
/// it, and nothing here synchronizes the device.

#include <cublas_api.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <functional>
#include <limits>
#include <memory>
#include <span>

#include "pd/common/result.h"
#include "pd/cuda/cuda_check.h"

namespace pd::cuda {

/// Number of visible CUDA devices; 0 when the runtime finds no device or no driver.
[[nodiscard]] int deviceCount();

namespace detail {
/// Logs a failed release (destructors never throw).
void logReleaseFailure(const Status& status) noexcept;
}  // namespace detail

/// A non-blocking stream on the current device.
class Stream {
 public:
  [[nodiscard]] static Result<Stream> create();
  [[nodiscard]] cudaStream_t get() const { return stream_.get(); }
  /// Blocks until the work queued so far has run; returns the first failure of that work.
  [[nodiscard]] Status synchronize() const;

 private:
  struct Deleter {
    void operator()(cudaStream_t stream) const noexcept;
  };
  explicit Stream(cudaStream_t stream) : stream_(stream) {}
  std::unique_ptr<CUstream_st, Deleter> stream_;
};

/// An event without timing, for ordering work between streams.
class Event {
 public:
  [[nodiscard]] static Result<Event> create();
  [[nodiscard]] cudaEvent_t get() const { return event_.get(); }
  /// Marks the point in `stream` that waiters wait for.
  [[nodiscard]] Status record(const Stream& stream) const;
  /// Makes `stream`'s later work wait until the recorded point has run.
  [[nodiscard]] Status waitOn(const Stream& stream) const;
  /// Blocks until the recorded point has run.
  [[nodiscard]] Status synchronize() const;

 private:
  struct Deleter {
    void operator()(cudaEvent_t event) const noexcept;
  };
  explicit Event(cudaEvent_t event) : event_(event) {}
  std::unique_ptr<CUevent_st, Deleter> event_;
};

namespace detail {
struct DeviceFree {
  void operator()(void* ptr) const noexcept;
};
struct PinnedFree {
  void operator()(void* ptr) const noexcept;
};
/// `count` elements of `element_bytes` without overflowing size_t, or InvalidArgument.
[[nodiscard]] Result<std::size_t> byteCount(std::size_t count, std::size_t element_bytes);
}  // namespace detail

/// `count` elements of T in device memory on the current device (uninitialized). A
/// default-constructed buffer is empty (size 0).
template <class T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  [[nodiscard]] static Result<DeviceBuffer> create(std::size_t count) {
    PD_ASSIGN_OR_RETURN(const std::size_t bytes, detail::byteCount(count, sizeof(T)));
    void* ptr = nullptr;
    if (bytes > 0) PD_CUDA_TRY(cudaMalloc(&ptr, bytes));
    return DeviceBuffer(static_cast<T*>(ptr), count);
  }
  [[nodiscard]] T* data() const { return data_.get(); }
  [[nodiscard]] std::size_t size() const { return size_; }
  [[nodiscard]] std::size_t bytes() const { return size_ * sizeof(T); }

  /// Queues a copy of `host` (at most size() elements) into the start of this buffer.
  [[nodiscard]] Status copyFromHost(std::span<const T> host, const Stream& stream) {
    if (host.size() > size_) return makeError(ErrorCode::InvalidArgument, "copyFromHost: more than the buffer holds");
    if (host.empty()) return okStatus();
    PD_CUDA_TRY(cudaMemcpyAsync(static_cast<void*>(data()), static_cast<const void*>(host.data()), host.size_bytes(),
                                cudaMemcpyHostToDevice, stream.get()));
    return okStatus();
  }
  /// Queues a copy of the buffer's first host.size() elements into `host`; the host memory must
  /// stay alive until the stream has run the copy.
  [[nodiscard]] Status copyToHost(std::span<T> host, const Stream& stream) const {
    if (host.size() > size_) return makeError(ErrorCode::InvalidArgument, "copyToHost: more than the buffer holds");
    if (host.empty()) return okStatus();
    PD_CUDA_TRY(cudaMemcpyAsync(static_cast<void*>(host.data()), static_cast<const void*>(data()), host.size_bytes(),
                                cudaMemcpyDeviceToHost, stream.get()));
    return okStatus();
  }

 private:
  struct Deleter {
    void operator()(T* ptr) const noexcept { detail::DeviceFree{}(static_cast<void*>(ptr)); }
  };
  DeviceBuffer(T* data, std::size_t size) : data_(data), size_(size) {}
  std::unique_ptr<T, Deleter> data_;
  std::size_t size_ = 0;
};

/// `count` elements of T in page-locked host memory (uninitialized): the host side of fast,
/// truly asynchronous copies.
template <class T>
class PinnedHostBuffer {
 public:
  [[nodiscard]] static Result<PinnedHostBuffer> create(std::size_t count) {
    PD_ASSIGN_OR_RETURN(const std::size_t bytes, detail::byteCount(count, sizeof(T)));
    void* ptr = nullptr;
    if (bytes > 0) PD_CUDA_TRY(cudaMallocHost(&ptr, bytes));
    return PinnedHostBuffer(static_cast<T*>(ptr), count);
  }
  [[nodiscard]] T* data() const { return data_.get(); }
  [[nodiscard]] std::size_t size() const { return size_; }
  [[nodiscard]] std::span<T> span() const { return {data_.get(), size_}; }

 private:
  struct Deleter {
    void operator()(T* ptr) const noexcept { detail::PinnedFree{}(ptr); }
  };
  PinnedHostBuffer(T* data, std::size_t size) : data_(data), size_(size) {}
  std::unique_ptr<T, Deleter> data_;
  std::size_t size_;
};

/// An instantiated CUDA graph: work captured once from a stream and replayed with one launch.
/// The captured kernels, copies and cuBLAS calls keep the pointers and sizes they were given, so
/// a replay redoes exactly that work on whatever those buffers hold at replay time.
class Graph {
 public:
  /// Captures what `body` queues on `stream` (thread-local capture mode: a call that is unsafe
  /// during capture, such as cudaMalloc on this thread, fails instead of running) and
  /// instantiates it. Nothing of the body runs during the capture. The capture is always ended,
  /// also when `body` fails; then body's error is returned and the stream is left out of capture.
  [[nodiscard]] static Result<Graph> capture(const Stream& stream, const std::function<Status()>& body);
  /// Queues one replay on `stream`.
  [[nodiscard]] Status launch(const Stream& stream) const;

 private:
  struct Deleter {
    void operator()(cudaGraphExec_t exec) const noexcept;
  };
  explicit Graph(cudaGraphExec_t exec) : exec_(exec) {}
  std::unique_ptr<CUgraphExec_st, Deleter> exec_;
};

/// A cuBLAS handle whose work runs on one stream (which must outlive it).
class BlasHandle {
 public:
  [[nodiscard]] static Result<BlasHandle> create(const Stream& stream);
  [[nodiscard]] cublasHandle_t get() const { return handle_.get(); }

 private:
  struct Deleter {
    void operator()(cublasHandle_t handle) const noexcept;
  };
  explicit BlasHandle(cublasHandle_t handle) : handle_(handle) {}
  std::unique_ptr<cublasContext, Deleter> handle_;
};

}  // namespace pd::cuda
