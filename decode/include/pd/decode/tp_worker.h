#pragma once
/// The process side of a tensor-parallel worker (docs/tensor-parallel.md):
/// (the rank process group that starts the ranks is comm::TpProcessGroup, process_group.h)
///  - TpFollowerWorker: the body of a decode follower rank: its own KV pool (same geometry and
///    block ids as the leader's), its own kvtransfer transport with the pool registered, its KV
///    target sent to the leader (exchangeKvTargets), then model::runTpFollower() until the leader stops
///    the group.
///
/// Start-up order (every step after the communicator is a collective, so both sides follow it):
///   leader:   comm::TpProcessGroup::start → createCpuEngine(tp = &group.comm()) → model::TpLeaderEngine →
///             KvPool + transport + exportTarget(0) → exchangeKvTargets → serve
///   follower: join (comm::TpProcessGroup::start, or createShm/TcpCommunicator for a spawned rank) →
///             createCpuEngine(tp) → TpFollowerWorker::start (pool, transport, exportTarget(r),
///             exchangeKvTargets) → run()
///
/// Thread rules: driven by one thread (the process's main / engine thread).

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "pd/comm/communicator.h"
#include "pd/common/internal_auth.h"
#include "pd/common/result.h"
#include "pd/decode/decode_config.h"
#include "pd/decode/kv_pool.h"
#include "pd/engine/engine.h"
#include "pd/kvtransfer/kvtransfer_config.h"
#include "pd/kvtransfer/transport.h"

namespace pd::decode {

struct TpFollowerOptions {
  DecodeConfig decode;  ///< num_blocks, block_size, kv_dtype as the leader's
  kvtransfer::KvTransferConfig kvtransfer;
  std::uint64_t model_hash = 0;  ///< as the leader's (CompatInfo)
  /// The cluster secret (may be null): records this rank's transport receives must be signed
  /// with it (UcxTransportOptions::auth).
  std::shared_ptr<const InternalAuth> auth;
};

class TpFollowerWorker {
 public:
  /// `engine` is this rank's shard (CpuEngineOptions::tp = &comm); `comm` must outlive the worker.
  /// Creates the pool (in the memory `engine` allocates: the CUDA engine's GPU memory, host memory
  /// otherwise) and the transport (kvtransfer.path as the leader's: a GPU pool lands through the
  /// staging path unless UCX registers GPU memory), registers the pool and exchanges KV targets
  /// with the group.
  static Result<std::unique_ptr<TpFollowerWorker>> start(std::unique_ptr<model::Engine> engine,
                                                         comm::Communicator& comm, TpFollowerOptions options);
  ~TpFollowerWorker();
  TpFollowerWorker(const TpFollowerWorker&) = delete;
  TpFollowerWorker& operator=(const TpFollowerWorker&) = delete;

  /// Serves the leader's calls until it stops the group (OK) or the group fails (the error). The
  /// leader's KV expectations arm this rank's transport, and its grants (TpLeaderEngine::grantKv)
  /// confine each request's writes to the request's blocks, as on the leader.
  Status run();
  [[nodiscard]] const KvPool& pool() const { return *pool_; }
  /// How KV reaches this rank's pool.
  [[nodiscard]] kvtransfer::KvTransferPath transferPath() const { return path_; }
  /// This rank's KV transport counters (thread-safe).
  [[nodiscard]] kvtransfer::TransportStats transportStats() const { return transport_->stats(); }

 private:
  TpFollowerWorker(std::unique_ptr<model::Engine> engine, comm::Communicator& comm, TpFollowerOptions options)
      : engine_(std::move(engine)), comm_(comm), options_(std::move(options)) {}
  // Arms the transport for `id`'s KV, re-arming after a failed attempt until `deadline` (a re-armed
  // expectation keeps its grant: Transport::grant).
  void expectUntil(std::uint64_t id, kvtransfer::Deadline deadline);
  // Grants the transport the leader's encoded descriptor for request `id`: this rank's own block
  // ids (`blocks` staging blocks on the staging path; empty: the descriptor's), or nullopt (and
  // the expectation cancelled, so nothing lands unconfined) when it cannot.
  std::optional<std::vector<std::uint32_t>> grant(std::uint64_t id, std::span<const std::byte> bytes,
                                                  std::uint32_t blocks);

  // TpLeaderEngine::awaitKv: true once `id`'s KV is in this rank's pool, waiting at most `timeout`.
  bool awaitLanded(std::uint64_t id, std::chrono::milliseconds timeout);
  // The outcome of `id`'s expectation (expectUntil's callback, on the transport's thread).
  void noteOutcome(std::uint64_t id, bool landed);

  std::unique_ptr<model::Engine> engine_;
  comm::Communicator& comm_;
  // Requests this rank expects KV for: false while it has not landed, true once it has; erased
  // when the expectation ends otherwise (cancelled, timed out), or once awaited.
  std::mutex kv_mutex_;
  std::condition_variable kv_changed_;
  std::unordered_map<std::uint64_t, bool> kv_landed_;  // guarded by kv_mutex_
  TpFollowerOptions options_;
  std::unique_ptr<KvPool> pool_;
  std::unique_ptr<kvtransfer::Transport> transport_;
  kvtransfer::KvTransferPath path_ = kvtransfer::KvTransferPath::Direct;
  kvtransfer::RegionId region_{};
  bool region_registered_ = false;
};

/// Every rank passes its own KV target (tp_rank = its rank); every rank gets all of them in rank
/// order (the leader puts them in each request's descriptor). A collective: all ranks call it.
Result<std::vector<kvtransfer::KvTarget>> exchangeKvTargets(comm::Communicator& comm, kvtransfer::KvTarget mine);

}  // namespace pd::decode
