#pragma once
// NCCL's part of the CUDA call check (pd/cuda/cuda_check.h) and a move-only owner of one
// non-blocking NCCL communicator (ncclComm_t), like the owners in pd/cuda/cuda_handles.h.
// Thread rules: a Comm belongs to its rank's thread.

#include <nccl.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string_view>

#include "pd/comm/nccl_bootstrap.h"
#include "pd/common/result.h"
#include "pd/cuda/cuda_check.h"

namespace pd::cuda {

/// ncclRemoteError / ncclSystemError -> PeerFailed (another rank or the network failed),
/// ncclInvalidArgument / ncclInvalidUsage -> InvalidArgument, anything else -> Internal.
/// ncclInProgress is a failure here; callers of non-blocking calls use nccl::issued().
[[nodiscard]] Status checkCall(ncclResult_t status, std::string_view call, std::string_view file, int line);

}  // namespace pd::cuda

namespace pd::comm::nccl {

static_assert(sizeof(ncclUniqueId) == kNcclIdBytes, "NCCL's unique id size changed");

/// A new NCCL unique id (rank 0 makes it; the others receive it through a bootstrap group).
[[nodiscard]] Result<NcclId> makeUniqueId();

/// A non-blocking call's result: ncclInProgress counts as issued (the caller then awaits it).
[[nodiscard]] inline ncclResult_t issued(ncclResult_t status) {
  return status == ncclInProgress ? ncclSuccess : status;
}

/// One rank's non-blocking NCCL communicator on the current device. Released with ncclCommAbort,
/// which never blocks: every collective is awaited before its call returns, so nothing is in flight.
class Comm {
 public:
  /// Collective over all `nranks` ranks (each with the same id and its own `rank`):
  /// ncclCommInitRankConfig with blocking = 0, polled by awaitNccl until `deadline` or a failure
  /// of `peers`; aborted on any failure.
  [[nodiscard]] static Result<Comm> init(const NcclId& id, int nranks, int rank,
                                         std::chrono::steady_clock::time_point deadline,
                                         const std::function<Status()>& peers);
  [[nodiscard]] ncclComm_t get() const { return comm_.get(); }
  /// One poll of the communicator's state (ncclCommGetAsyncError): Done, InProgress, or its error.
  [[nodiscard]] Result<NcclProgress> poll() const;
  /// ncclCommAbort now; get() is null afterwards.
  void abort() { comm_.reset(); }

 private:
  struct Deleter {
    void operator()(ncclComm_t comm) const noexcept;
  };
  explicit Comm(ncclComm_t comm) : comm_(comm) {}
  std::unique_ptr<ncclComm, Deleter> comm_;
};

}  // namespace pd::comm::nccl
