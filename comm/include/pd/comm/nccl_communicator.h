#pragma once
/// The NCCL Communicator: collectives between GPU ranks (one device per rank) through NCCL.
/// The engine's activations are host float32, so each collective stages them through a device
/// buffer (host -> device, NCCL collective, device -> host) on the rank's own stream; a GPU
/// engine would call NCCL on its device tensors directly through the same seam.
///
/// Built only when CUDA and NCCL are found (PD_WITH_CUDA and libnccl); otherwise, and on a
/// machine without a GPU, createNcclCommunicator() says Unsupported. The communicator is
/// non-blocking: every collective is polled (ncclCommGetAsyncError, cudaStreamQuery) until its
/// deadline and aborted (ncclCommAbort) on a failure, a timeout or a dead bootstrap peer, after
/// which every call fails at once with PeerFailed.
/// Thread rules: as communicator.h (one thread per rank at a time).

#include <memory>

#include "pd/comm/communicator.h"
#include "pd/common/result.h"

namespace pd::comm {

/// Whether this binary was built with NCCL.
[[nodiscard]] bool builtWithNccl();

/// Creates rank bootstrap.rank() of a group of bootstrap.size() ranks on CUDA device `device`:
/// bootstrapCommunicator(bootstrap, *ncclCommunicatorFactory(), {device}) (nccl_bootstrap.h: rank
/// 0 makes the id, the frame is checked, every NCCL wait has a deadline). Every rank must call
/// this together. Unsupported without CUDA/NCCL or device; PeerFailed when another rank failed.
Result<std::unique_ptr<Communicator>> createNcclCommunicator(Communicator& bootstrap, int device);

}  // namespace pd::comm
