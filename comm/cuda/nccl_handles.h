#pragma once
// NCCL's part of the CUDA call check (pd/cuda/cuda_check.h) and a move-only owner of one NCCL
// communicator (ncclComm_t), like the owners in pd/cuda/cuda_handles.h.
// Thread rules: a Comm belongs to its rank's thread.

#include <nccl.h>

#include <array>
#include <cstddef>
#include <memory>
#include <string_view>

#include "pd/common/result.h"
#include "pd/cuda/cuda_check.h"

namespace pd::cuda {

/// ncclRemoteError / ncclSystemError -> PeerFailed (another rank or the network failed),
/// ncclInvalidArgument / ncclInvalidUsage -> InvalidArgument, anything else -> Internal.
[[nodiscard]] Status checkCall(ncclResult_t status, std::string_view call, std::string_view file, int line);

}  // namespace pd::cuda

namespace pd::comm::nccl {

using UniqueId = std::array<unsigned char, sizeof(ncclUniqueId)>;

/// A new NCCL unique id (rank 0 makes it; the others receive it through a bootstrap group).
[[nodiscard]] Result<UniqueId> makeUniqueId();

/// One rank's NCCL communicator on the current device.
class Comm {
 public:
  /// Collective over all `nranks` ranks: each calls it with the same id and its own `rank`.
  [[nodiscard]] static Result<Comm> create(const UniqueId& id, int nranks, int rank);
  [[nodiscard]] ncclComm_t get() const { return comm_.get(); }

 private:
  struct Deleter {
    void operator()(ncclComm_t comm) const noexcept;
  };
  explicit Comm(ncclComm_t comm) : comm_(comm) {}
  std::unique_ptr<ncclComm, Deleter> comm_;
};

}  // namespace pd::comm::nccl
