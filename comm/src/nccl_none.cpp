// Build without NCCL of pd/comm/nccl_communicator.h: the NCCL communicator is Unsupported.
#include "pd/comm/nccl_communicator.h"

namespace pd::comm {

bool builtWithNccl() {
  return false;
}

Result<std::unique_ptr<Communicator>> createNcclCommunicator(Communicator& /*bootstrap*/, int /*device*/) {
  return makeError(ErrorCode::Unsupported, "this pdserve was built without NCCL (needs PD_WITH_CUDA and libnccl)");
}

}  // namespace pd::comm
