#pragma once
/// Device collectives staged through the host (comm/device_collectives.h): each call waits for
/// the stream, copies the device buffer into pinned host memory, runs the host Communicator's
/// collective (shm, tcp, loopback threads) and copies the result back. Slower than NCCL and never
/// captured into a CUDA graph (it waits for the stream), but it runs wherever the host group
/// runs: ranks that share one GPU (NCCL refuses two ranks on one device), the one-GPU tensor
/// parallel test, and groups without NCCL.
///
/// Private to the CUDA backend (engine/cuda). Thread rules: the rank's engine thread only.

#include <memory>

#include "pd/comm/communicator.h"
#include "pd/comm/device_collectives.h"
#include "pd/common/result.h"

namespace pd::gpu {

/// Staged collectives over `host` (not owned; it must outlive the result).
[[nodiscard]] std::unique_ptr<comm::DeviceCollectives> stageDeviceCollectives(comm::Communicator& host);

}  // namespace pd::gpu
