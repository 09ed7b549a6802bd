// Communicator helpers and the in-process loopback group (ranks are threads; unit tests).
#include "pd/comm/communicator.h"

#include <fmt/format.h>

#include <condition_variable>
#include <cstring>
#include <mutex>

namespace pd::comm {

Status allGatherFloats(Communicator& comm, std::span<const float> send, std::span<float> recv) {
  return comm.allGather(std::as_bytes(send), std::as_writable_bytes(recv));
}

Result<std::vector<std::byte>> broadcastMessage(Communicator& comm, std::vector<std::byte> message, int root,
                                                bool unbounded) {
  std::uint64_t length = comm.rank() == root ? message.size() : 0;
  const std::span<std::byte> length_bytes(reinterpret_cast<std::byte*>(&length), sizeof(length));
  PD_TRY(unbounded ? comm.broadcastUnbounded(length_bytes, root) : comm.broadcast(length_bytes, root));
  if (length > (std::uint64_t{1} << 40)) {
    return makeError(ErrorCode::Corrupt, fmt::format("broadcast message of {} bytes", length));
  }
  if (comm.rank() != root) message.assign(length, std::byte{0});
  if (length > 0) PD_TRY(comm.broadcast(message, root));
  return message;
}

namespace {

// State shared by the threads of a loopback group. Every collective is: deposit into this
// rank's slot, wait until all deposited (phase 1), read, wait until all read (phase 2), so a
// slot is never overwritten while someone still reads it.
struct LoopbackState {
  explicit LoopbackState(int n, std::chrono::milliseconds t)
      : size(n), timeout(t), slots(static_cast<std::size_t>(n)) {}

  const int size;
  const std::chrono::milliseconds timeout;
  std::mutex mu;
  std::condition_variable cv;
  std::uint64_t generation = 0;  // completed rendezvous
  int arrived = 0;
  bool broken = false;
  std::vector<std::vector<std::byte>> slots;

  // Blocks until every rank arrived at this rendezvous (or the deadline passed / a peer failed).
  Status rendezvous(bool bounded) {
    std::unique_lock lock(mu);
    if (broken) return makeError(ErrorCode::PeerFailed, "loopback group is broken by an earlier failure");
    const std::uint64_t gen = generation;
    if (++arrived == size) {
      arrived = 0;
      ++generation;
      cv.notify_all();
      return okStatus();
    }
    const auto done = [&] { return generation != gen || broken; };
    if (bounded) {
      if (!cv.wait_for(lock, timeout, done)) {
        broken = true;
        cv.notify_all();
        return makeError(ErrorCode::Timeout,
                         fmt::format("loopback collective: peers did not arrive within {} ms", timeout.count()));
      }
    } else {
      cv.wait(lock, done);
    }
    if (generation == gen) return makeError(ErrorCode::PeerFailed, "loopback group broken by a peer's failure");
    return okStatus();
  }
};

class LoopbackCommunicator final : public Communicator {
 public:
  LoopbackCommunicator(std::shared_ptr<LoopbackState> state, int rank) : state_(std::move(state)), rank_(rank) {}

  [[nodiscard]] int rank() const override { return rank_; }
  [[nodiscard]] int size() const override { return state_->size; }
  [[nodiscard]] std::string kind() const override { return "loopback"; }

  Status allReduceSum(std::span<float> data) override {
    deposit(std::as_bytes(data));
    PD_TRY(state_->rendezvous(true));
    for (std::size_t i = 0; i < data.size(); ++i) data[i] = 0.0F;
    for (int r = 0; r < state_->size; ++r) {
      const std::vector<std::byte>& slot = state_->slots[static_cast<std::size_t>(r)];
      if (slot.size() != data.size_bytes()) return mismatch("allReduceSum", r);
      const auto* src = reinterpret_cast<const float*>(slot.data());
      for (std::size_t i = 0; i < data.size(); ++i) data[i] += src[i];
    }
    return state_->rendezvous(true);
  }

  Status allGather(std::span<const std::byte> send, std::span<std::byte> recv) override {
    if (recv.size() != send.size() * static_cast<std::size_t>(state_->size)) {
      return makeError(ErrorCode::InvalidArgument, "allGather: recv must be size() times send");
    }
    deposit(send);
    PD_TRY(state_->rendezvous(true));
    for (int r = 0; r < state_->size; ++r) {
      const std::vector<std::byte>& slot = state_->slots[static_cast<std::size_t>(r)];
      if (slot.size() != send.size()) return mismatch("allGather", r);
      if (!slot.empty()) std::memcpy(recv.data() + static_cast<std::size_t>(r) * send.size(), slot.data(), slot.size());
    }
    return state_->rendezvous(true);
  }

  Status broadcast(std::span<std::byte> data, int root) override { return doBroadcast(data, root, true); }
  Status broadcastUnbounded(std::span<std::byte> data, int root) override { return doBroadcast(data, root, false); }

  Status barrier() override { return state_->rendezvous(true); }

 private:
  void deposit(std::span<const std::byte> bytes) {
    std::lock_guard lock(state_->mu);
    state_->slots[static_cast<std::size_t>(rank_)].assign(bytes.begin(), bytes.end());
  }

  Status mismatch(const char* what, int peer) {
    std::lock_guard lock(state_->mu);
    state_->broken = true;
    state_->cv.notify_all();
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("{}: rank {} passed a different length than rank {}", what, peer, rank_));
  }

  Status doBroadcast(std::span<std::byte> data, int root, bool bounded) {
    if (root < 0 || root >= state_->size) return makeError(ErrorCode::InvalidArgument, "broadcast: bad root");
    deposit(rank_ == root ? std::span<const std::byte>(data) : std::span<const std::byte>());
    PD_TRY(state_->rendezvous(rank_ == root || bounded));
    if (rank_ != root) {
      const std::vector<std::byte>& slot = state_->slots[static_cast<std::size_t>(root)];
      if (slot.size() != data.size()) return mismatch("broadcast", root);
      if (!slot.empty()) std::memcpy(data.data(), slot.data(), slot.size());
    }
    return state_->rendezvous(true);
  }

  std::shared_ptr<LoopbackState> state_;  // shared by the group's ranks; lives until the last one goes
  int rank_;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> createLoopbackGroup(int size, const LoopbackOptions& options) {
  PD_CHECK(size >= 1);
  auto state = std::make_shared<LoopbackState>(size, options.timeout);
  std::vector<std::unique_ptr<Communicator>> group;
  group.reserve(static_cast<std::size_t>(size));
  for (int r = 0; r < size; ++r) group.push_back(std::make_unique<LoopbackCommunicator>(state, r));
  return group;
}

}  // namespace pd::comm
