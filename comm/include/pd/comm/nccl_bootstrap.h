#pragma once
/// Bootstrapping a device communicator (NCCL) over a rank group that already exists (the shm or
/// tcp communicator of TpProcessGroup), and waiting on NCCL without ever blocking past a deadline.
///
/// The steps of bootstrapCommunicator(), every rank calling it together:
///  1. rank 0 asks the factory for a unique id and broadcasts one fixed-size frame over the
///     bootstrap group: magic, version, a status (id follows / rank 0 failed), the rank count, the
///     id's length, the group tag (cluster/job: e.g. the model hash) and the id;
///  2. every other rank decodes the frame as hostile bytes (decodeNcclIdFrame: length, magic,
///     version, rank count, id length, tag, an all-zero id);
///  3. the ranks agree (one all-reduce over the bootstrap group) that every rank accepted the id;
///     any refusal fails every rank before any of them enters NCCL;
///  4. each rank joins through the factory with a deadline (the NCCL factory: a non-blocking
///     communicator polled with ncclCommGetAsyncError and aborted at the deadline or when the
///     bootstrap group sees a peer die);
///  5. the ranks agree again that every rank joined; a rank that failed makes every rank fail,
///     and the ranks that had joined drop (abort) their communicators.
/// A rank that never arrives fails the others within the bootstrap group's own collective
/// deadline. Every failure caused by another rank is PeerFailed; a refused frame is the decode
/// error on the refusing rank and PeerFailed on the others.
///
/// Thread rules: bootstrapCommunicator() runs on the rank's main thread, which must not use the
/// bootstrap communicator meanwhile. awaitNccl() is a pure loop over its callbacks.

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "pd/comm/communicator.h"
#include "pd/common/result.h"

namespace pd::comm {

/// An NCCL unique id's bytes (NCCL_UNIQUE_ID_BYTES; the NCCL build checks the size).
inline constexpr std::size_t kNcclIdBytes = 128;
using NcclId = std::array<std::byte, kNcclIdBytes>;

/// The seam between the bootstrap logic and NCCL: the real factory (ncclCommunicatorFactory)
/// calls NCCL, tests use a fake. Thread rules: one rank's thread at a time.
class CommunicatorFactory {
 public:
  virtual ~CommunicatorFactory() = default;
  /// A fresh unique id (rank 0 only). Unsupported where NCCL is not built or no device is.
  virtual Result<NcclId> makeId() = 0;
  /// Joins rank `rank` of `size` on CUDA device `device` to the group of `id`. Must return by
  /// `deadline` (Timeout) and as soon as `peers` reports a failure (PeerFailed), releasing what it
  /// made. `peers` may be called from this thread at any time.
  virtual Result<std::unique_ptr<Communicator>> join(const NcclId& id, int rank, int size, int device,
                                                     std::chrono::steady_clock::time_point deadline,
                                                     const std::function<Status()>& peers) = 0;
};

/// The NCCL factory: makeId = ncclGetUniqueId; join = cudaSetDevice, ncclCommInitRankConfig with
/// `blocking = 0`, polled by awaitNccl (ncclCommGetAsyncError) and ncclCommAbort on the deadline,
/// an NCCL error or a peer failure. Its communicators wait on every collective the same way, with
/// `collective_timeout` as the deadline and the bootstrap group's checkPeers() as the peer check
/// (the bootstrap communicator must outlive them). In a build without NCCL both calls are
/// Unsupported.
[[nodiscard]] std::unique_ptr<CommunicatorFactory> ncclCommunicatorFactory(
    std::chrono::milliseconds collective_timeout = std::chrono::seconds(30));

struct NcclBootstrapOptions {
  int device = 0;                                  ///< this rank's CUDA device index
  std::uint64_t group_tag = 0;                     ///< every rank must pass the same (cluster/job identity)
  std::chrono::milliseconds join_timeout{120000};  ///< step 4's deadline, from the frame's arrival
};

/// Steps 1-5 above. PeerFailed when another rank failed or never arrived; the factory's error
/// (Unsupported, InvalidArgument, Timeout...) when this rank's own part failed; the frame's
/// decode error when this rank refused rank 0's frame.
[[nodiscard]] Result<std::unique_ptr<Communicator>> bootstrapCommunicator(Communicator& bootstrap,
                                                                          CommunicatorFactory& factory,
                                                                          const NcclBootstrapOptions& options);

/// The device communicator of one rank of a tensor-parallel worker (docs/tensor-parallel.md,
/// "NCCL"): when the model runs on CUDA (`first_device` >= 0) and `group` has more than one rank,
/// bootstrapCommunicator over `group` with `factory` (nullptr: the NCCL factory) on device
/// `first_device + local_rank` (the rank's index on its machine); nullptr otherwise (CPU ranks
/// compute over `group` itself). Every rank of the group calls it at the same point.
[[nodiscard]] Result<std::unique_ptr<Communicator>> joinDeviceGroup(Communicator& group, int first_device,
                                                                    int local_rank, std::uint64_t group_tag,
                                                                    std::chrono::milliseconds join_timeout,
                                                                    CommunicatorFactory* factory = nullptr);

/// The frame's size on the wire (fixed; nothing is allocated from a received length).
inline constexpr std::size_t kNcclIdFrameBytes = 4 + 2 + 2 + 4 + 4 + 8 + kNcclIdBytes;

/// Rank 0's frame: the id for a group of `ranks` tagged `group_tag`, or (id == nullptr) the
/// notice that rank 0 could not make one.
[[nodiscard]] std::array<std::byte, kNcclIdFrameBytes> encodeNcclIdFrame(const NcclId* id, int ranks,
                                                                         std::uint64_t group_tag);

/// The id in `frame`, checked: Corrupt for a wrong length, magic, version, id length or an
/// all-zero id; PeerFailed when rank 0 says it failed; InvalidArgument when the rank count or the
/// tag differs from this rank's (another group's or job's id).
[[nodiscard]] Result<NcclId> decodeNcclIdFrame(std::span<const std::byte> frame, int expected_ranks,
                                               std::uint64_t expected_tag);

/// What one poll of an NCCL operation says.
enum class NcclProgress { Done, InProgress };

/// Polls `poll` until it says Done (OK), fails (its error), `deadline` passes (Timeout) or `peers`
/// fails (PeerFailed, checked every `peer_interval`). On every failure `abort` runs once before
/// returning, so nothing is left blocked. `what` names the operation in the error.
[[nodiscard]] Status awaitNccl(const std::function<Result<NcclProgress>()>& poll, const std::function<Status()>& peers,
                               const std::function<void()>& abort, std::chrono::steady_clock::time_point deadline,
                               std::string_view what,
                               std::chrono::milliseconds peer_interval = std::chrono::milliseconds(20));

}  // namespace pd::comm
