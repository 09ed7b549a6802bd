// CUDA + NCCL build of pd/comm/nccl_communicator.h and the NCCL CommunicatorFactory: host data is
// staged through a device buffer that grows to the largest collective seen, on the rank's own
// stream; every NCCL call is non-blocking and awaited with a deadline (awaitNccl).
#include "pd/comm/nccl_communicator.h"

#include <fmt/format.h>

#include <cstddef>
#include <utility>

#include "nccl_handles.h"
#include "pd/comm/device_collectives.h"
#include "pd/comm/nccl_bootstrap.h"
#include "pd/common/log.h"
#include "pd/cuda/cuda_handles.h"

namespace pd::comm {
namespace {

class NcclCommunicator final : public Communicator {
 public:
  /// Makes `device` current and creates the rank's stream, communicator and staging buffer.
  static Result<std::unique_ptr<Communicator>> create(const NcclId& id, int rank, int size, int device,
                                                      std::chrono::steady_clock::time_point deadline,
                                                      std::function<Status()> peers,
                                                      std::chrono::milliseconds collective_timeout) {
    PD_CUDA_TRY(cudaSetDevice(device));
    PD_ASSIGN_OR_RETURN(cuda::Stream stream, cuda::Stream::create());
    PD_ASSIGN_OR_RETURN(nccl::Comm comm, nccl::Comm::init(id, size, rank, deadline, peers));
    PD_ASSIGN_OR_RETURN(cuda::DeviceBuffer<std::byte> staging, cuda::DeviceBuffer<std::byte>::create(kStagingBytes));
    return std::unique_ptr<Communicator>(new NcclCommunicator(rank, size, device, std::move(peers), collective_timeout,
                                                              std::move(stream), std::move(comm), std::move(staging)));
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
    return collective("ncclAllReduce", [&]() -> Status {
      PD_TRY(ensureStaging(bytes));
      PD_CUDA_TRY(cudaMemcpyAsync(staging_.data(), data.data(), bytes, cudaMemcpyHostToDevice, stream_.get()));
      PD_CUDA_TRY(nccl::issued(ncclAllReduce(staging_.data(), staging_.data(), data.size(), ncclFloat32, ncclSum,
                                             comm_.get(), stream_.get())));
      PD_TRY(await("ncclAllReduce issue"));
      PD_CUDA_TRY(cudaMemcpyAsync(data.data(), staging_.data(), bytes, cudaMemcpyDeviceToHost, stream_.get()));
      return await("ncclAllReduce");
    });
  }
  Status allGather(std::span<const std::byte> send, std::span<std::byte> recv) override {
    if (recv.size() != send.size() * static_cast<std::size_t>(size_)) {
      return makeError(ErrorCode::InvalidArgument, "allGather: recv must be size() times send");
    }
    if (send.empty()) return okStatus();
    return collective("ncclAllGather", [&]() -> Status {
      PD_TRY(ensureStaging(recv.size() + send.size()));
      std::byte* dev_recv = staging_.data();
      std::byte* dev_send = dev_recv + recv.size();
      PD_CUDA_TRY(cudaMemcpyAsync(dev_send, send.data(), send.size(), cudaMemcpyHostToDevice, stream_.get()));
      PD_CUDA_TRY(nccl::issued(ncclAllGather(dev_send, dev_recv, send.size(), ncclUint8, comm_.get(), stream_.get())));
      PD_TRY(await("ncclAllGather issue"));
      PD_CUDA_TRY(cudaMemcpyAsync(recv.data(), dev_recv, recv.size(), cudaMemcpyDeviceToHost, stream_.get()));
      return await("ncclAllGather");
    });
  }
  Status broadcast(std::span<std::byte> data, int root) override {
    if (root < 0 || root >= size_) return makeError(ErrorCode::InvalidArgument, "broadcast: bad root");
    if (data.empty()) return okStatus();
    return collective("ncclBroadcast", [&]() -> Status {
      PD_TRY(ensureStaging(data.size()));
      PD_CUDA_TRY(cudaMemcpyAsync(staging_.data(), data.data(), data.size(), cudaMemcpyHostToDevice, stream_.get()));
      PD_CUDA_TRY(nccl::issued(
          ncclBroadcast(staging_.data(), staging_.data(), data.size(), ncclUint8, root, comm_.get(), stream_.get())));
      PD_TRY(await("ncclBroadcast issue"));
      PD_CUDA_TRY(cudaMemcpyAsync(data.data(), staging_.data(), data.size(), cudaMemcpyDeviceToHost, stream_.get()));
      return await("ncclBroadcast");
    });
  }
  Status barrier() override {
    float one = 1.0F;
    return allReduceSum(std::span(&one, 1));
  }
  Status checkPeers() override { return peers_ ? peers_() : okStatus(); }
  DeviceCollectives* deviceCollectives() override { return &on_device_; }

 private:
  // The same communicator over the caller's device buffers and stream (device_collectives.h):
  // each call only enqueues (waiting for NCCL to accept a non-blocking call, never for the
  // stream), so a CUDA graph may capture it; awaitStream() polls like the host collectives.
  class Device final : public DeviceCollectives {
   public:
    explicit Device(NcclCommunicator& c) : c_(c) {}
    [[nodiscard]] int rank() const override { return c_.rank_; }
    [[nodiscard]] int size() const override { return c_.size_; }
    [[nodiscard]] std::string kind() const override { return "nccl"; }
    [[nodiscard]] bool capturable() const override { return true; }
    Status allReduceSum(float* data, std::size_t count, void* stream) override {
      if (count == 0) return okStatus();
      if (data == nullptr) return makeError(ErrorCode::InvalidArgument, "device allReduceSum: null buffer");
      return c_.enqueue("ncclAllReduce (device)", [&] {
        return ncclAllReduce(data, data, count, ncclFloat32, ncclSum, c_.comm_.get(),
                             static_cast<cudaStream_t>(stream));
      });
    }
    Status allGather(const float* send, float* recv, std::size_t count, void* stream) override {
      if (count == 0) return okStatus();
      if (send == nullptr || recv == nullptr) {
        return makeError(ErrorCode::InvalidArgument, "device allGather: null buffer");
      }
      return c_.enqueue("ncclAllGather (device)", [&] {
        return ncclAllGather(send, recv, count, ncclFloat32, c_.comm_.get(), static_cast<cudaStream_t>(stream));
      });
    }
    Status awaitStream(void* stream) override {
      return c_.collective("device step", [&] { return c_.awaitOn(static_cast<cudaStream_t>(stream), "device step"); });
    }

   private:
    NcclCommunicator& c_;
  };

  // Issues one non-blocking NCCL call and waits (within the deadline) until NCCL took it.
  template <class Call>
  Status enqueue(std::string_view what, Call&& call) {
    return collective(what, [&]() -> Status {
      PD_CUDA_TRY(nccl::issued(std::forward<Call>(call)()));
      return awaitNccl([this]() -> Result<NcclProgress> { return comm_.poll(); }, peers_, [this] { comm_.abort(); },
                       deadline_, what);
    });
  }
  static constexpr std::size_t kStagingBytes = std::size_t{1} << 20;

  NcclCommunicator(int rank, int size, int device, std::function<Status()> peers,
                   std::chrono::milliseconds collective_timeout, cuda::Stream stream, nccl::Comm comm,
                   cuda::DeviceBuffer<std::byte> staging)
      : rank_(rank),
        size_(size),
        device_(device),
        peers_(std::move(peers)),
        collective_timeout_(collective_timeout),
        stream_(std::move(stream)),
        comm_(std::move(comm)),
        staging_(std::move(staging)),
        on_device_(*this) {}

  Status ensureStaging(std::size_t bytes) {
    if (bytes <= staging_.size()) return okStatus();
    staging_ = {};  // free the old buffer before the larger one
    PD_ASSIGN_OR_RETURN(staging_, cuda::DeviceBuffer<std::byte>::create(bytes));
    return okStatus();
  }

  // Waits until the communicator has no call in progress and the stream ran dry, within the
  // collective's deadline; aborts the communicator on a failure (awaitNccl).
  Status await(std::string_view what) { return awaitOn(stream_.get(), what); }
  Status awaitOn(cudaStream_t stream, std::string_view what) {
    return awaitNccl(
        [this, stream]() -> Result<NcclProgress> {
          PD_ASSIGN_OR_RETURN(const NcclProgress comm_state, comm_.poll());
          if (comm_state == NcclProgress::InProgress) return NcclProgress::InProgress;
          const cudaError_t query = cudaStreamQuery(stream);
          if (query == cudaErrorNotReady) {
            (void)cudaGetLastError();  // "not ready" also set the last error: a later launch check would see it
            return NcclProgress::InProgress;
          }
          PD_CUDA_TRY(query);
          return NcclProgress::Done;
        },
        peers_, [this] { comm_.abort(); }, deadline_, what);
  }

  // A failed collective means the group is broken, whatever the call said: later calls fail at once.
  template <class Body>
  Status collective(std::string_view what, Body&& body) {
    if (broken_) return makeError(ErrorCode::PeerFailed, fmt::format("{}: the NCCL group is broken", what));
    deadline_ = std::chrono::steady_clock::now() + collective_timeout_;
    Status status = std::forward<Body>(body)();
    if (status.ok()) return status;
    broken_ = true;
    comm_.abort();
    return makeError(ErrorCode::PeerFailed, "nccl: " + status.error().message);
  }

  int rank_;
  int size_;
  int device_;
  std::function<Status()> peers_;
  std::chrono::milliseconds collective_timeout_;
  std::chrono::steady_clock::time_point deadline_{};
  bool broken_ = false;
  cuda::Stream stream_;
  nccl::Comm comm_;
  cuda::DeviceBuffer<std::byte> staging_;
  Device on_device_;  // last: refers to the members above
};

class NcclFactory final : public CommunicatorFactory {
 public:
  explicit NcclFactory(std::chrono::milliseconds collective_timeout) : collective_timeout_(collective_timeout) {}
  Result<NcclId> makeId() override {
    PD_TRY(checkDevice(0));
    return nccl::makeUniqueId();
  }
  Result<std::unique_ptr<Communicator>> join(const NcclId& id, int rank, int size, int device,
                                             std::chrono::steady_clock::time_point deadline,
                                             const std::function<Status()>& peers) override {
    PD_TRY(checkDevice(device));
    return NcclCommunicator::create(id, rank, size, device, deadline, peers, collective_timeout_);
  }

 private:
  static Status checkDevice(int device) {
    const int devices = cuda::deviceCount();
    if (devices == 0) return makeError(ErrorCode::Unsupported, "nccl communicator: no CUDA device visible");
    if (device < 0 || device >= devices) {
      return makeError(ErrorCode::InvalidArgument,
                       fmt::format("nccl communicator: device {} of {} visible", device, devices));
    }
    return okStatus();
  }
  std::chrono::milliseconds collective_timeout_;
};

}  // namespace

bool builtWithNccl() {
  return true;
}

std::unique_ptr<CommunicatorFactory> ncclCommunicatorFactory(std::chrono::milliseconds collective_timeout) {
  return std::make_unique<NcclFactory>(collective_timeout);
}

Result<std::unique_ptr<Communicator>> createNcclCommunicator(Communicator& bootstrap, int device) {
  NcclBootstrapOptions options;
  options.device = device;
  return bootstrapCommunicator(bootstrap, *ncclCommunicatorFactory(), options);
}

}  // namespace pd::comm
