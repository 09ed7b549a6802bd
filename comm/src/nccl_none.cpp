// Build without NCCL of pd/comm/nccl_communicator.h and the NCCL factory: both are Unsupported.
#include "pd/comm/nccl_bootstrap.h"
#include "pd/comm/nccl_communicator.h"

namespace pd::comm {
namespace {

constexpr const char* kWithoutNccl = "this pdserve was built without NCCL (needs PD_WITH_CUDA and libnccl)";

class NoNcclFactory final : public CommunicatorFactory {
 public:
  Result<NcclId> makeId() override { return makeError(ErrorCode::Unsupported, kWithoutNccl); }
  Result<std::unique_ptr<Communicator>> join(const NcclId& /*id*/, int /*rank*/, int /*size*/, int /*device*/,
                                             std::chrono::steady_clock::time_point /*deadline*/,
                                             const std::function<Status()>& /*peers*/) override {
    return makeError(ErrorCode::Unsupported, kWithoutNccl);
  }
};

}  // namespace

bool builtWithNccl() {
  return false;
}

std::unique_ptr<CommunicatorFactory> ncclCommunicatorFactory(std::chrono::milliseconds /*collective_timeout*/) {
  return std::make_unique<NoNcclFactory>();
}

Result<std::unique_ptr<Communicator>> createNcclCommunicator(Communicator& bootstrap, int device) {
  NcclBootstrapOptions options;
  options.device = device;
  return bootstrapCommunicator(bootstrap, *ncclCommunicatorFactory(), options);
}

}  // namespace pd::comm
