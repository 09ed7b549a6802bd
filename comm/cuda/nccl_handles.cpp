#include "nccl_handles.h"

#include <cstring>

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

Result<UniqueId> makeUniqueId() {
  ncclUniqueId id;
  PD_CUDA_TRY(ncclGetUniqueId(&id));
  UniqueId bytes{};
  std::memcpy(bytes.data(), &id, sizeof(id));
  return bytes;
}

Result<Comm> Comm::create(const UniqueId& id_bytes, int nranks, int rank) {
  ncclUniqueId id;
  std::memcpy(&id, id_bytes.data(), sizeof(id));
  ncclComm_t comm = nullptr;
  PD_CUDA_TRY(ncclCommInitRank(&comm, nranks, id, rank));
  return Comm(comm);
}

void Comm::Deleter::operator()(ncclComm_t comm) const noexcept {
  cuda::detail::logReleaseFailure(PD_CUDA_STATUS(ncclCommDestroy(comm)));
}

}  // namespace pd::comm::nccl
