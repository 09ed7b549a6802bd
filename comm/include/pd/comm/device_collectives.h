#pragma once
/// Collectives over device memory, ordered on the caller's CUDA stream: what the CUDA engine's
/// tensor parallelism calls inside a decode step (docs/tensor-parallel.md, "On GPUs"). Two
/// implementations:
///  - the NCCL communicator's own (Communicator::deviceCollectives() of a "nccl" communicator):
///    ncclAllReduce / ncclAllGather on the device buffers themselves, enqueued on the stream and
///    never waited for inside a call, so a CUDA graph may capture them;
///  - staged (engine/cuda: stageDeviceCollectives): device -> pinned host, any host Communicator,
///    host -> device; it waits for the stream, so it is never captured. For ranks that share one
///    GPU (NCCL refuses two ranks on one device) and for tests.
///
/// Streams are `void*` (a cudaStream_t) so that this header needs no CUDA.
/// Failures: as communicator.h. An enqueued collective may still fail or hang on the device
/// (a peer died): awaitStream() is how the caller waits for its stream, never past the
/// collective deadline; after a failure every later call fails at once with PeerFailed.
/// Thread rules: the rank's engine thread only.

#include <cstddef>
#include <string>

#include "pd/common/result.h"

namespace pd::comm {

class DeviceCollectives {
 public:
  virtual ~DeviceCollectives() = default;
  [[nodiscard]] virtual int rank() const = 0;
  [[nodiscard]] virtual int size() const = 0;
  /// "nccl", "staged(shm)", ...
  [[nodiscard]] virtual std::string kind() const = 0;
  /// Whether the calls may be recorded into a CUDA graph (they only enqueue work on the stream).
  [[nodiscard]] virtual bool capturable() const = 0;
  /// data[0, count) (device) = the sum over the ranks, in place, ordered on `stream`. Every rank
  /// passes the same count.
  virtual Status allReduceSum(float* data, std::size_t count, void* stream) = 0;
  /// recv[r * count + i] = rank r's send[i] (device buffers, recv holds size() * count).
  virtual Status allGather(const float* send, float* recv, std::size_t count, void* stream) = 0;
  /// Waits until everything enqueued on `stream` ran, polling the group: a failed or vanished
  /// peer, or the collective deadline passing, aborts the group and returns PeerFailed / Timeout
  /// instead of blocking forever.
  virtual Status awaitStream(void* stream) = 0;
};

}  // namespace pd::comm
