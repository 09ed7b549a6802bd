#pragma once
/// Collective communication between the ranks of a tensor-parallel group (DESIGN §4: decode
/// ranks on one machine). Three implementations behind one seam:
///  - createLoopbackGroup(): ranks are threads of one process (unit tests);
///  - ShmCommunicator (shm_communicator.h): ranks are processes on one machine, over a POSIX
///    shared-memory segment;
///  - createNcclCommunicator(): NCCL over GPU buffers (CUDA builds; Unsupported otherwise).
///
/// Every rank of a group must call the same collectives in the same order with the same sizes
/// (as with MPI/NCCL). Reductions sum in rank order 0..size-1 on every rank, so every rank gets
/// bitwise the same result (ranks then make the same routing and sampling decisions).
///
/// Failures: a peer that died or did not arrive within the deadline gives PeerFailed / Timeout,
/// never a hang; after a failure the group is broken (every later call fails at once).
/// Thread rules: one thread per rank calls a communicator at a time (the rank's engine thread).

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "pd/common/result.h"

namespace pd::comm {

class DeviceCollectives;

class Communicator {
 public:
  virtual ~Communicator() = default;
  [[nodiscard]] virtual int rank() const = 0;
  [[nodiscard]] virtual int size() const = 0;
  /// "loopback", "shm", "nccl".
  [[nodiscard]] virtual std::string kind() const = 0;

  /// data = sum over ranks of data, in place; every rank passes the same length.
  virtual Status allReduceSum(std::span<float> data) = 0;
  /// recv = concatenation of every rank's send in rank order; recv.size() = size() * send.size().
  virtual Status allGather(std::span<const std::byte> send, std::span<std::byte> recv) = 0;
  /// Root's data is copied into every other rank's data (same length everywhere).
  virtual Status broadcast(std::span<std::byte> data, int root) = 0;
  virtual Status barrier() = 0;
  /// Like broadcast(), but a non-root rank waits without the collective deadline (still failing
  /// at once when a peer dies): for followers idling until the leader's next step.
  virtual Status broadcastUnbounded(std::span<std::byte> data, int root) { return broadcast(data, root); }
  /// Whether the peers still seem reachable, without taking part in a collective: a watchdog for
  /// an idle group (e.g. the leader between steps). Unlike the collectives it may be called from
  /// any thread, also while another thread runs a collective. OK when nothing is known to be
  /// wrong (the default: no cheap check); PeerFailed when a peer is gone, or the error that
  /// broke the group.
  virtual Status checkPeers() { return okStatus(); }
  /// The same group's collectives over device memory (device_collectives.h), owned by this
  /// communicator; nullptr when it has none (every kind but "nccl").
  virtual DeviceCollectives* deviceCollectives() { return nullptr; }
};

/// Float convenience over Communicator::allGather.
Status allGatherFloats(Communicator& comm, std::span<const float> send, std::span<float> recv);

/// Broadcasts a message of any length from `root`: the root passes its bytes, the others get
/// them back (the length travels first). `unbounded` as in broadcastUnbounded().
Result<std::vector<std::byte>> broadcastMessage(Communicator& comm, std::vector<std::byte> message, int root,
                                                bool unbounded = false);

struct LoopbackOptions {
  std::chrono::milliseconds timeout{30000};  ///< a collective's deadline
};

/// `size` communicators, one per rank, for threads of this process; rank i is element i. They
/// share state; destroy them after every thread stopped using them. size >= 1.
std::vector<std::unique_ptr<Communicator>> createLoopbackGroup(int size, const LoopbackOptions& options = {});

}  // namespace pd::comm
