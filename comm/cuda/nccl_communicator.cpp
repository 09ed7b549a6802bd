// CUDA + NCCL build of pd/comm/nccl_communicator.h: the Communicator over nccl_ops.h.
#include "pd/comm/nccl_communicator.h"

#include <fmt/format.h>

#include <array>

#include "nccl_ops.h"
#include "pd/common/log.h"

namespace pd::comm {
namespace {

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(nccl::NcclRank* handle, int rank, int size) : handle_(handle), rank_(rank), size_(size) {}
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;
  ~NcclCommunicator() override { nccl::destroyRank(handle_); }

  [[nodiscard]] int rank() const override { return rank_; }
  [[nodiscard]] int size() const override { return size_; }
  [[nodiscard]] std::string kind() const override { return "nccl"; }

  Status allReduceSum(std::span<float> data) override {
    if (data.empty()) return barrier();
    return check(nccl::allReduceSumHost(handle_, data.data(), data.size()));
  }
  Status allGather(std::span<const std::byte> send, std::span<std::byte> recv) override {
    if (recv.size() != send.size() * static_cast<std::size_t>(size_)) {
      return makeError(ErrorCode::InvalidArgument, "allGather: recv must be size() times send");
    }
    if (send.empty()) return okStatus();
    return check(nccl::allGatherHost(handle_, send.data(), recv.data(), send.size()));
  }
  Status broadcast(std::span<std::byte> data, int root) override {
    if (root < 0 || root >= size_) return makeError(ErrorCode::InvalidArgument, "broadcast: bad root");
    if (data.empty()) return okStatus();
    return check(nccl::broadcastHost(handle_, data.data(), data.size(), root));
  }
  Status barrier() override { return check(nccl::barrier(handle_)); }

 private:
  static Status check(const std::string& err) {
    if (err.empty()) return okStatus();
    return makeError(ErrorCode::PeerFailed, "nccl: " + err);
  }

  nccl::NcclRank* handle_;  // owned
  int rank_;
  int size_;
};

}  // namespace

bool builtWithNccl() {
  return true;
}

Result<std::unique_ptr<Communicator>> createNcclCommunicator(Communicator& bootstrap, int device) {
  const int devices = nccl::deviceCount();
  if (devices == 0) return makeError(ErrorCode::Unsupported, "nccl communicator: no CUDA device visible");
  if (device < 0 || device >= devices) {
    return makeError(ErrorCode::InvalidArgument, fmt::format("nccl communicator: device {} of {}", device, devices));
  }
  std::array<unsigned char, nccl::kUniqueIdBytes> id{};
  std::string id_error;
  if (bootstrap.rank() == 0) id_error = nccl::makeUniqueId(id.data());
  // Every rank takes part in the broadcast even when rank 0 failed (a zero id tells them).
  PD_TRY(bootstrap.broadcast(std::as_writable_bytes(std::span(id)), 0));
  if (!id_error.empty()) return makeError(ErrorCode::Internal, "nccl communicator: " + id_error);
  if (id == std::array<unsigned char, nccl::kUniqueIdBytes>{}) {
    return makeError(ErrorCode::PeerFailed, "nccl communicator: rank 0 could not make an NCCL id");
  }
  nccl::NcclRank* handle = nullptr;
  if (std::string err =
          nccl::initRank(id.data(), bootstrap.size(), bootstrap.rank(), device, std::size_t{1} << 20, &handle);
      !err.empty()) {
    return makeError(ErrorCode::PeerFailed, "nccl communicator: " + err);
  }
  log::debug("comm", "nccl rank {} of {} on device {}", bootstrap.rank(), bootstrap.size(), device);
  return std::unique_ptr<Communicator>(std::make_unique<NcclCommunicator>(handle, bootstrap.rank(), bootstrap.size()));
}

}  // namespace pd::comm
