// createCudaCopier in a build without CUDA.
#include "pd/kvtransfer/device_copier.h"

namespace pd::kvtransfer {

Result<std::unique_ptr<DeviceCopier>> createCudaCopier(int /*device*/) {
  return makeError(ErrorCode::Unsupported, "this build has no CUDA: the staging path copies with the host copier");
}

}  // namespace pd::kvtransfer
