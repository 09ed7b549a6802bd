#include "nccl_handles.h"

#include <fmt/format.h>

#include <cstring>
#include <utility>

#include "pd/cuda/cuda_handles.h"

namespace pd::cuda {

Status checkCall(ncclResult_t status, std::string_view call, std::string_view file, int line) {
  if (status == ncclSuccess) return okStatus();
  ErrorCode code = ErrorCode::Internal;
  switch (status) {
    case ncclRemoteError:
    case ncclSystemError:
      code = ErrorCode::PeerFailed;
      break;
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      code = ErrorCode::InvalidArgument;
      break;
    default:
      break;
  }
  return callError(code, call, ncclGetErrorString(status), file, line);
}

}  // namespace pd::cuda

namespace pd::comm::nccl {

Result<NcclId> makeUniqueId() {
  ncclUniqueId id;
  PD_CUDA_TRY(ncclGetUniqueId(&id));
  NcclId bytes{};
  std::memcpy(bytes.data(), &id, sizeof(id));
  return bytes;
}

Result<Comm> Comm::init(const NcclId& id_bytes, int nranks, int rank, std::chrono::steady_clock::time_point deadline,
                        const std::function<Status()>& peers) {
  ncclUniqueId id;
  std::memcpy(&id, id_bytes.data(), sizeof(id));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // every wait is ours, with a deadline
  ncclComm_t raw = nullptr;
  const ncclResult_t started = ncclCommInitRankConfig(&raw, nranks, id, rank, &config);
  Comm comm(raw);  // owned from here: aborted on every failure below
  PD_CUDA_TRY(issued(started));
  if (raw == nullptr) return makeError(ErrorCode::Internal, "ncclCommInitRankConfig gave no communicator");
  PD_TRY(awaitNccl([&comm] { return comm.poll(); }, peers, [&comm] { comm.abort(); }, deadline,
                   fmt::format("ncclCommInitRank (rank {} of {})", rank, nranks)));
  return comm;
}

Result<NcclProgress> Comm::poll() const {
  if (!comm_) return makeError(ErrorCode::PeerFailed, "the NCCL communicator was aborted");
  ncclResult_t state = ncclSuccess;
  PD_CUDA_TRY(ncclCommGetAsyncError(comm_.get(), &state));
  if (state == ncclInProgress) return NcclProgress::InProgress;
  // The communicator's asynchronous error (a peer's failure, a network error) names itself.
  PD_TRY(cuda::checkCall(state, "the NCCL communicator's asynchronous state", __FILE__, __LINE__));
  return NcclProgress::Done;
}

void Comm::Deleter::operator()(ncclComm_t comm) const noexcept {
  cuda::detail::logReleaseFailure(PD_CUDA_STATUS(ncclCommAbort(comm)));
}

}  // namespace pd::comm::nccl
