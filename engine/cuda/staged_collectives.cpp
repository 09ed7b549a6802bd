// Device collectives staged through pinned host memory (staged_collectives.h).
#include "staged_collectives.h"

#include <fmt/format.h>

#include <cstring>
#include <optional>
#include <span>

#include "pd/cuda/cuda_check.h"
#include "pd/cuda/cuda_handles.h"

namespace pd::gpu {
namespace {

class StagedCollectives final : public comm::DeviceCollectives {
 public:
  explicit StagedCollectives(comm::Communicator& host) : host_(host) {}
  [[nodiscard]] int rank() const override { return host_.rank(); }
  [[nodiscard]] int size() const override { return host_.size(); }
  [[nodiscard]] std::string kind() const override { return fmt::format("staged({})", host_.kind()); }
  [[nodiscard]] bool capturable() const override { return false; }

  Status allReduceSum(float* data, std::size_t count, void* stream) override {
    if (count == 0) return okStatus();
    if (data == nullptr) return makeError(ErrorCode::InvalidArgument, "staged allReduceSum: null buffer");
    const auto s = static_cast<cudaStream_t>(stream);
    PD_TRY(ensure(count));
    PD_CUDA_TRY(cudaMemcpyAsync(pinned_->data(), data, count * sizeof(float), cudaMemcpyDeviceToHost, s));
    PD_CUDA_TRY(cudaStreamSynchronize(s));
    PD_TRY(host_.allReduceSum(std::span<float>(pinned_->data(), count)));
    PD_CUDA_TRY(cudaMemcpyAsync(data, pinned_->data(), count * sizeof(float), cudaMemcpyHostToDevice, s));
    PD_CUDA_TRY(cudaStreamSynchronize(s));  // the pinned buffer is reused by the next call
    return okStatus();
  }

  Status allGather(const float* send, float* recv, std::size_t count, void* stream) override {
    if (count == 0) return okStatus();
    if (send == nullptr || recv == nullptr) {
      return makeError(ErrorCode::InvalidArgument, "staged allGather: null buffer");
    }
    const auto s = static_cast<cudaStream_t>(stream);
    const auto ranks = static_cast<std::size_t>(host_.size());
    PD_TRY(ensure(count * (ranks + 1)));
    float* mine = pinned_->data() + count * ranks;
    PD_CUDA_TRY(cudaMemcpyAsync(mine, send, count * sizeof(float), cudaMemcpyDeviceToHost, s));
    PD_CUDA_TRY(cudaStreamSynchronize(s));
    PD_TRY(comm::allGatherFloats(host_, std::span<const float>(mine, count),
                                 std::span<float>(pinned_->data(), count * ranks)));
    PD_CUDA_TRY(cudaMemcpyAsync(recv, pinned_->data(), count * ranks * sizeof(float), cudaMemcpyHostToDevice, s));
    PD_CUDA_TRY(cudaStreamSynchronize(s));
    return okStatus();
  }

  // Nothing of the group is in flight between calls: the host collectives already waited.
  Status awaitStream(void* stream) override {
    PD_CUDA_TRY(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
    return okStatus();
  }

 private:
  Status ensure(std::size_t count) {
    if (pinned_ && pinned_->size() >= count) return okStatus();
    pinned_.reset();
    PD_ASSIGN_OR_RETURN(cuda::PinnedHostBuffer<float> buf, cuda::PinnedHostBuffer<float>::create(count));
    pinned_.emplace(std::move(buf));
    return okStatus();
  }

  comm::Communicator& host_;
  std::optional<cuda::PinnedHostBuffer<float>> pinned_;
};

}  // namespace

std::unique_ptr<comm::DeviceCollectives> stageDeviceCollectives(comm::Communicator& host) {
  return std::make_unique<StagedCollectives>(host);
}

}  // namespace pd::gpu
