#pragma once
/// The device-copy seam of the staging KV path (docs/kv-transfer.md, "Staging path"): copies
/// between the memory a KV pool lives in ("device" memory) and host staging buffers registered with
/// the network transport, asynchronously, each answered by one callback.
///
/// Implementations: a host copier (memcpy on one worker thread), for pools in host memory and for
/// CPU tests where host memory stands in for the device; and a CUDA copier (cudaMemcpyAsync on its
/// own stream, completion seen through a cudaEvent per copy), available in CUDA builds only.
///
/// Thread rules: every method is thread-safe. Callbacks run on the copier's own completion thread
/// (one per instance), in submission order; they must not block, and they may call copy() again.
/// Destroying a copier answers the copies it has not started with Cancelled, waits for the ones
/// running, and runs no callback after it returns.

#include <cstddef>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "pd/common/result.h"

namespace pd::kvtransfer {

enum class CopyDirection {
  DeviceToHost,  ///< from the KV pool ("device") into a host staging buffer
  HostToDevice,  ///< from a host staging buffer into the KV pool
};

/// One contiguous copy of `bytes` from `src` to `dst`.
struct CopySpan {
  void* dst = nullptr;
  const void* src = nullptr;
  std::size_t bytes = 0;
};

/// Called once per batch: ok when every span landed, else the first failure.
using CopyDoneFn = std::function<void(Status status)>;

/// Host memory for staging buffers, owned: page-locked when the copier needs that for truly
/// asynchronous copies (CUDA), ordinary zeroed memory otherwise. Move-only.
class StagingMemory {
 public:
  using Release = void (*)(std::byte*) noexcept;
  StagingMemory(std::byte* data, std::size_t size, Release release) : data_(data, release), size_(size) {}
  [[nodiscard]] std::span<std::byte> span() const { return {data_.get(), size_}; }

 private:
  std::unique_ptr<std::byte, Release> data_;
  std::size_t size_;
};

class DeviceCopier {
 public:
  DeviceCopier() = default;
  virtual ~DeviceCopier() = default;
  DeviceCopier(const DeviceCopier&) = delete;
  DeviceCopier& operator=(const DeviceCopier&) = delete;
  DeviceCopier(DeviceCopier&&) = delete;
  DeviceCopier& operator=(DeviceCopier&&) = delete;

  /// "host", "cuda".
  [[nodiscard]] virtual std::string name() const = 0;
  /// `bytes` of host memory for staging buffers, zero-filled. ResourceExhausted when it cannot
  /// be had.
  [[nodiscard]] virtual Result<StagingMemory> allocateHost(std::size_t bytes) = 0;
  /// Queues a batch of copies, all in `direction`, answered by one `on_done` (one event on CUDA,
  /// however many spans); the memory of every span must stay valid until then. Never blocks on
  /// the copies. Ok: `on_done` follows exactly once. An error (the copier is shutting down, a copy
  /// could not be queued): `on_done` is never called, though spans before the failing one may
  /// still be copied.
  [[nodiscard]] virtual Status copy(CopyDirection direction, std::vector<CopySpan> spans, CopyDoneFn on_done) = 0;
};

/// memcpy on one worker thread: "device" memory is host memory.
[[nodiscard]] std::unique_ptr<DeviceCopier> createHostCopier();

/// cudaMemcpyAsync on a stream of its own on `device` (-1: the calling thread's current device),
/// one event per copy. Unsupported in a build without CUDA or on a machine without a GPU.
[[nodiscard]] Result<std::unique_ptr<DeviceCopier>> createCudaCopier(int device = -1);

}  // namespace pd::kvtransfer
