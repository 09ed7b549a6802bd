// CUDA + NCCL build of pd/comm/nccl_communicator.h: host data is staged through a device buffer
// that grows to the largest collective seen, on the rank's own stream.
#include "pd/comm/nccl_communicator.h"

#include <fmt/format.h>

#include <cstddef>
#include <utility>

#include "nccl_handles.h"
#include "pd/common/log.h"
#include "pd/cuda/cuda_handles.h"

namespace pd::comm {
namespace {

class NcclCommunicator final : public Communicator {
 public:
  /// Makes `device` current and creates the rank's stream, communicator and staging buffer.
  static Result<std::unique_ptr<Communicator>> create(const nccl::UniqueId& id, int rank, int size, int device) {
    PD_CUDA_TRY(cudaSetDevice(device));
    PD_ASSIGN_OR_RETURN(cuda::Stream stream, cuda::Stream::create());
    PD_ASSIGN_OR_RETURN(nccl::Comm comm, nccl::Comm::create(id, size, rank));
    PD_ASSIGN_OR_RETURN(cuda::DeviceBuffer<std::byte> staging, cuda::DeviceBuffer<std::byte>::create(kStagingBytes));
    return std::unique_ptr<Communicator>(
        new NcclCommunicator(rank, size, device, std::move(stream), std::move(comm), std::move(staging)));
  }
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;
  NcclCommunicator(NcclCommunicator&&) = delete;
  NcclCommunicator& operator=(NcclCommunicator&&) = delete;
  // The owners free on the current device: make it this rank's before they go (in reverse).
  ~NcclCommunicator() override { cuda::detail::logReleaseFailure(PD_CUDA_STATUS(cudaSetDevice(device_))); }

  [[nodiscard]] int rank() const override { return rank_; }
  [[nodiscard]] int size() const override { return size_; }
  [[nodiscard]] std::string kind() const override { return "nccl"; }

  Status allReduceSum(std::span<float> data) override {
    if (data.empty()) return barrier();
    const std::size_t bytes = data.size_bytes();
    return peerStatus([&]() -> Status {
      PD_TRY(ensureStaging(bytes));
      PD_CUDA_TRY(cudaMemcpyAsync(staging_.data(), data.data(), bytes, cudaMemcpyHostToDevice, stream_.get()));
      PD_CUDA_TRY(ncclAllReduce(staging_.data(), staging_.data(), data.size(), ncclFloat32, ncclSum, comm_.get(),
                                stream_.get()));
      PD_CUDA_TRY(cudaMemcpyAsync(data.data(), staging_.data(), bytes, cudaMemcpyDeviceToHost, stream_.get()));
      return stream_.synchronize();
    });
  }
  Status allGather(std::span<const std::byte> send, std::span<std::byte> recv) override {
    if (recv.size() != send.size() * static_cast<std::size_t>(size_)) {
      return makeError(ErrorCode::InvalidArgument, "allGather: recv must be size() times send");
    }
    if (send.empty()) return okStatus();
    return peerStatus([&]() -> Status {
      PD_TRY(ensureStaging(recv.size() + send.size()));
      std::byte* dev_recv = staging_.data();
      std::byte* dev_send = dev_recv + recv.size();
      PD_CUDA_TRY(cudaMemcpyAsync(dev_send, send.data(), send.size(), cudaMemcpyHostToDevice, stream_.get()));
      PD_CUDA_TRY(ncclAllGather(dev_send, dev_recv, send.size(), ncclUint8, comm_.get(), stream_.get()));
      PD_CUDA_TRY(cudaMemcpyAsync(recv.data(), dev_recv, recv.size(), cudaMemcpyDeviceToHost, stream_.get()));
      return stream_.synchronize();
    });
  }
  Status broadcast(std::span<std::byte> data, int root) override {
    if (root < 0 || root >= size_) return makeError(ErrorCode::InvalidArgument, "broadcast: bad root");
    if (data.empty()) return okStatus();
    return peerStatus([&]() -> Status {
      PD_TRY(ensureStaging(data.size()));
      PD_CUDA_TRY(cudaMemcpyAsync(staging_.data(), data.data(), data.size(), cudaMemcpyHostToDevice, stream_.get()));
      PD_CUDA_TRY(
          ncclBroadcast(staging_.data(), staging_.data(), data.size(), ncclUint8, root, comm_.get(), stream_.get()));
      PD_CUDA_TRY(cudaMemcpyAsync(data.data(), staging_.data(), data.size(), cudaMemcpyDeviceToHost, stream_.get()));
      return stream_.synchronize();
    });
  }
  Status barrier() override {
    float one = 1.0F;
    return allReduceSum(std::span(&one, 1));
  }

 private:
  static constexpr std::size_t kStagingBytes = std::size_t{1} << 20;

  NcclCommunicator(int rank, int size, int device, cuda::Stream stream, nccl::Comm comm,
                   cuda::DeviceBuffer<std::byte> staging)
      : rank_(rank),
        size_(size),
        device_(device),
        stream_(std::move(stream)),
        comm_(std::move(comm)),
        staging_(std::move(staging)) {}

  Status ensureStaging(std::size_t bytes) {
    if (bytes <= staging_.size()) return okStatus();
    staging_ = {};  // free the old buffer before the larger one
    PD_ASSIGN_OR_RETURN(staging_, cuda::DeviceBuffer<std::byte>::create(bytes));
    return okStatus();
  }

  // A failed collective means the group is broken, whatever the call said.
  template <class Body>
  static Status peerStatus(Body&& body) {
    Status status = std::forward<Body>(body)();
    if (status.ok()) return status;
    return makeError(ErrorCode::PeerFailed, "nccl: " + status.error().message);
  }

  int rank_;
  int size_;
  int device_;
  cuda::Stream stream_;
  nccl::Comm comm_;
  cuda::DeviceBuffer<std::byte> staging_;
};

}  // namespace

bool builtWithNccl() {
  return true;
}

Result<std::unique_ptr<Communicator>> createNcclCommunicator(Communicator& bootstrap, int device) {
  const int devices = cuda::deviceCount();
  if (devices == 0) return makeError(ErrorCode::Unsupported, "nccl communicator: no CUDA device visible");
  if (device < 0 || device >= devices) {
    return makeError(ErrorCode::InvalidArgument, fmt::format("nccl communicator: device {} of {}", device, devices));
  }
  nccl::UniqueId id{};
  Status id_status = okStatus();
  if (bootstrap.rank() == 0) {
    Result<nccl::UniqueId> made = nccl::makeUniqueId();
    if (made.ok()) {
      id = *made;
    } else {
      id_status = std::move(made).error();
    }
  }
  // Every rank takes part in the broadcast even when rank 0 failed (a zero id tells them).
  PD_TRY(bootstrap.broadcast(std::as_writable_bytes(std::span(id)), 0));
  if (!id_status.ok()) return makeError(ErrorCode::Internal, "nccl communicator: " + id_status.error().message);
  if (id == nccl::UniqueId{}) {
    return makeError(ErrorCode::PeerFailed, "nccl communicator: rank 0 could not make an NCCL id");
  }
  auto communicator = NcclCommunicator::create(id, bootstrap.rank(), bootstrap.size(), device);
  if (!communicator.ok()) {
    return makeError(ErrorCode::PeerFailed, "nccl communicator: " + communicator.error().message);
  }
  log::debug("comm", "nccl rank {} of {} on device {}", bootstrap.rank(), bootstrap.size(), device);
  return communicator;
}

}  // namespace pd::comm
