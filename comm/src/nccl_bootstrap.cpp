// Bootstrap of a device communicator over an existing rank group, the id frame, and the
// deadline-bounded NCCL wait (pd/comm/nccl_bootstrap.h). No NCCL here: it is built everywhere.
#include "pd/comm/nccl_bootstrap.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <thread>
#include <utility>

#include "pd/common/log.h"

namespace pd::comm {
namespace {

constexpr std::uint32_t kFrameMagic = 0x434e4450;  // "PDNC" little-endian
constexpr std::uint16_t kFrameVersion = 1;
constexpr std::uint16_t kStatusId = 0;
constexpr std::uint16_t kStatusFailed = 1;

template <class T>
void put(std::byte*& at, T value) {
  for (std::size_t i = 0; i < sizeof(T); ++i) {
    *at++ = static_cast<std::byte>((static_cast<std::uint64_t>(value) >> (8 * i)) & 0xff);
  }
}

template <class T>
T get(const std::byte*& at) {
  std::uint64_t v = 0;
  for (std::size_t i = 0; i < sizeof(T); ++i) v |= static_cast<std::uint64_t>(*at++) << (8 * i);
  return static_cast<T>(v);
}

// One all-reduce of this rank's "failed" flag: how many ranks failed (PeerFailed if the group did).
Result<int> countFailures(Communicator& bootstrap, bool failed) {
  float flag = failed ? 1.0F : 0.0F;
  if (Status s = bootstrap.allReduceSum(std::span(&flag, 1)); !s.ok()) {
    return makeError(ErrorCode::PeerFailed, "nccl bootstrap: agreeing with the other ranks: " + s.error().message);
  }
  return static_cast<int>(flag);
}

}  // namespace

std::array<std::byte, kNcclIdFrameBytes> encodeNcclIdFrame(const NcclId* id, int ranks, std::uint64_t group_tag) {
  std::array<std::byte, kNcclIdFrameBytes> frame{};
  std::byte* at = frame.data();
  put(at, kFrameMagic);
  put(at, kFrameVersion);
  put(at, id != nullptr ? kStatusId : kStatusFailed);
  put(at, static_cast<std::uint32_t>(ranks));
  put(at, static_cast<std::uint32_t>(kNcclIdBytes));
  put(at, group_tag);
  if (id != nullptr) std::memcpy(at, id->data(), kNcclIdBytes);
  return frame;
}

Result<NcclId> decodeNcclIdFrame(std::span<const std::byte> frame, int expected_ranks, std::uint64_t expected_tag) {
  if (frame.size() != kNcclIdFrameBytes) {
    return makeError(ErrorCode::Corrupt,
                     fmt::format("nccl id frame of {} bytes (expected {})", frame.size(), kNcclIdFrameBytes));
  }
  const std::byte* at = frame.data();
  const auto magic = get<std::uint32_t>(at);
  const auto version = get<std::uint16_t>(at);
  const auto status = get<std::uint16_t>(at);
  const auto ranks = get<std::uint32_t>(at);
  const auto id_bytes = get<std::uint32_t>(at);
  const auto tag = get<std::uint64_t>(at);
  if (magic != kFrameMagic) return makeError(ErrorCode::Corrupt, fmt::format("nccl id frame: magic {:#x}", magic));
  if (version != kFrameVersion) {
    return makeError(ErrorCode::Corrupt,
                     fmt::format("nccl id frame: version {} (this build speaks {})", version, kFrameVersion));
  }
  if (status == kStatusFailed) return makeError(ErrorCode::PeerFailed, "nccl bootstrap: rank 0 could not make an id");
  if (status != kStatusId) return makeError(ErrorCode::Corrupt, fmt::format("nccl id frame: status {}", status));
  if (expected_ranks <= 0 || ranks != static_cast<std::uint32_t>(expected_ranks)) {
    return makeError(
        ErrorCode::InvalidArgument,
        fmt::format("nccl id frame is for a group of {} ranks, this rank's group has {}", ranks, expected_ranks));
  }
  if (id_bytes != kNcclIdBytes) {
    return makeError(ErrorCode::Corrupt,
                     fmt::format("nccl id frame: id of {} bytes (expected {})", id_bytes, kNcclIdBytes));
  }
  if (tag != expected_tag) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("nccl id frame belongs to group tag {:016x}, this rank's is {:016x} (another "
                                 "cluster or job?)",
                                 tag, expected_tag));
  }
  NcclId id{};
  std::memcpy(id.data(), at, kNcclIdBytes);
  if (std::all_of(id.begin(), id.end(), [](std::byte b) { return b == std::byte{0}; })) {
    return makeError(ErrorCode::Corrupt, "nccl id frame: the id is all zeros");
  }
  return id;
}

Result<std::unique_ptr<Communicator>> bootstrapCommunicator(Communicator& bootstrap, CommunicatorFactory& factory,
                                                            const NcclBootstrapOptions& options) {
  const int rank = bootstrap.rank();
  const int size = bootstrap.size();

  // 1. Rank 0's id (or its failure) reaches every rank in one fixed-size frame.
  std::array<std::byte, kNcclIdFrameBytes> frame{};
  Status made = okStatus();
  if (rank == 0) {
    Result<NcclId> id = factory.makeId();
    if (id.ok()) {
      frame = encodeNcclIdFrame(&*id, size, options.group_tag);
    } else {
      made = id.error();
      frame = encodeNcclIdFrame(nullptr, size, options.group_tag);
    }
  }
  if (Status s = bootstrap.broadcast(frame, 0); !s.ok()) {
    return makeError(ErrorCode::PeerFailed,
                     fmt::format("nccl bootstrap rank {}: the id exchange failed: {}", rank, s.error().message));
  }
  if (!made.ok()) return made.error();  // every other rank reads the failure from the frame

  // 2. and 3. Every rank checks the frame; all go on only if all accepted it.
  Result<NcclId> id = decodeNcclIdFrame(frame, size, options.group_tag);
  if (!id.ok() && id.error().code == ErrorCode::PeerFailed) return id.error();
  PD_ASSIGN_OR_RETURN(const int refused, countFailures(bootstrap, !id.ok()));
  if (!id.ok()) {
    log::error("comm", "nccl bootstrap rank {}: refused rank 0's id: {}", rank, id.error().toString());
    return id.error();
  }
  if (refused > 0) {
    return makeError(ErrorCode::PeerFailed, fmt::format("nccl bootstrap: {} rank(s) refused rank 0's id", refused));
  }

  // 4. and 5. Every rank joins with a deadline; all keep their communicators only if all joined.
  const auto deadline = std::chrono::steady_clock::now() + options.join_timeout;
  Result<std::unique_ptr<Communicator>> joined =
      factory.join(*id, rank, size, options.device, deadline, [&bootstrap] { return bootstrap.checkPeers(); });
  PD_ASSIGN_OR_RETURN(const int failed, countFailures(bootstrap, !joined.ok()));
  if (!joined.ok()) return joined.error();
  if (failed > 0) {
    return makeError(ErrorCode::PeerFailed,
                     fmt::format("nccl bootstrap: {} rank(s) could not join the communicator", failed));
  }
  log::info("comm", "nccl communicator rank {} of {} on device {} joined", rank, size, options.device);
  return joined;
}

Result<std::unique_ptr<Communicator>> joinDeviceGroup(Communicator& group, int first_device, int local_rank,
                                                      std::uint64_t group_tag, std::chrono::milliseconds join_timeout,
                                                      CommunicatorFactory* factory) {
  if (first_device < 0 || group.size() == 1) return std::unique_ptr<Communicator>();
  std::unique_ptr<CommunicatorFactory> nccl;
  if (factory == nullptr) {
    nccl = ncclCommunicatorFactory();
    factory = nccl.get();
  }
  NcclBootstrapOptions options;
  options.device = first_device + local_rank;
  options.group_tag = group_tag;
  options.join_timeout = join_timeout;
  return bootstrapCommunicator(group, *factory, options);
}

Status awaitNccl(const std::function<Result<NcclProgress>()>& poll, const std::function<Status()>& peers,
                 const std::function<void()>& abort, std::chrono::steady_clock::time_point deadline,
                 std::string_view what, std::chrono::milliseconds peer_interval) {
  using Clock = std::chrono::steady_clock;
  auto next_peer_check = Clock::now() + peer_interval;
  for (std::uint64_t polls = 0;; ++polls) {
    Result<NcclProgress> progress = poll();
    if (!progress.ok()) {
      abort();
      return makeError(progress.error().code, fmt::format("{}: {}", what, progress.error().message));
    }
    if (*progress == NcclProgress::Done) return okStatus();
    const auto now = Clock::now();
    if (now >= deadline) {
      abort();
      return makeError(ErrorCode::Timeout, fmt::format("{}: not done by its deadline (communicator aborted)", what));
    }
    if (now >= next_peer_check) {
      next_peer_check = now + peer_interval;
      if (Status s = peers ? peers() : okStatus(); !s.ok()) {
        abort();
        return makeError(ErrorCode::PeerFailed,
                         fmt::format("{}: a peer failed (communicator aborted): {}", what, s.error().message));
      }
    }
    // Spin briefly (a collective takes microseconds), then yield the core.
    if (polls < 1000) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
}

}  // namespace pd::comm
