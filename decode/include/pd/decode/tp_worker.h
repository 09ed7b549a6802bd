#pragma once
/// The process side of a tensor-parallel decode worker (docs/tensor-parallel.md):
///  - TpLeaderGroup: rank 0 spawns ranks 1..N-1 as child processes (`pdserve decode ...
///    --decode.tp_rank r --decode.tp_group NAME`, i.e. its own command line plus those two
///    flags) and joins them in a shared-memory communicator (shm_communicator.h);
///  - TpFollowerWorker: the body of such a child: its own KV pool (same geometry and block ids as
///    the leader's), its own kvtransfer transport with the pool registered, its KV target sent to
///    the leader (exchangeKvTargets), then runTpFollower() until the leader stops the group.
///
/// Start-up order (every step after the communicator is a collective, so both sides follow it):
///   leader:   TpLeaderGroup::start → createCpuEngine(tp = &group.comm()) → TpLeaderEngine →
///             KvPool + transport + exportTarget(0) → exchangeKvTargets → serve
///   follower: createShmCommunicator(rank r) → createCpuEngine(tp) → TpFollowerWorker::start
///             (pool, transport, exportTarget(r), exchangeKvTargets) → run()
///
/// Thread rules: both classes are driven by one thread (the process's main / engine thread).

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "pd/common/communicator.h"
#include "pd/common/model/engine.h"
#include "pd/common/result.h"
#include "pd/common/subprocess.h"
#include "pd/decode/decode_config.h"
#include "pd/decode/kv_pool.h"
#include "pd/kvtransfer/kvtransfer_config.h"
#include "pd/kvtransfer/transport.h"

namespace pd::decode {

class TpLeaderGroup {
 public:
  /// Spawns size - 1 followers running `follower_argv` (argv[0] = the pdserve executable) plus
  /// `--decode.tp_rank r --decode.tp_group <name>`, and waits up to `join_timeout` (model load
  /// included) until all joined. A follower that exits before joining fails start() at once
  /// with PeerFailed. The children get SIGKILL if this process dies. `inject_latency` is the
  /// TEST-ONLY ShmOptions::inject_latency of the leader's communicator (0 = off).
  static Result<std::unique_ptr<TpLeaderGroup>> start(int size, std::vector<std::string> follower_argv,
                                                      std::chrono::milliseconds join_timeout,
                                                      std::chrono::microseconds inject_latency = {});
  /// Waits up to 10 s for the followers to exit (stop the TpLeaderEngine first), then kills them.
  ~TpLeaderGroup();
  TpLeaderGroup(const TpLeaderGroup&) = delete;
  TpLeaderGroup& operator=(const TpLeaderGroup&) = delete;

  [[nodiscard]] comm::Communicator& comm() { return *comm_; }
  [[nodiscard]] const std::string& groupName() const { return name_; }
  /// Follower exit statuses so far (nullopt: still running), rank 1 first.
  std::vector<std::optional<int>> pollFollowers();

 private:
  TpLeaderGroup() = default;
  std::string name_;
  std::vector<std::unique_ptr<proc::Subprocess>> followers_;
  std::unique_ptr<comm::Communicator> comm_;
};

struct TpFollowerOptions {
  DecodeConfig decode;  ///< num_blocks, block_size, kv_dtype as the leader's
  kvtransfer::KvTransferConfig kvtransfer;
  std::uint64_t model_hash = 0;  ///< as the leader's (CompatInfo)
};

class TpFollowerWorker {
 public:
  /// `engine` is this rank's shard (CpuEngineOptions::tp = &comm); `comm` must outlive the worker.
  /// Creates the pool and transport, registers the pool and exchanges KV targets with the group.
  static Result<std::unique_ptr<TpFollowerWorker>> start(std::unique_ptr<model::Engine> engine,
                                                         comm::Communicator& comm, TpFollowerOptions options);
  ~TpFollowerWorker();
  TpFollowerWorker(const TpFollowerWorker&) = delete;
  TpFollowerWorker& operator=(const TpFollowerWorker&) = delete;

  /// Serves the leader's calls until it stops the group (OK) or the group fails (the error).
  Status run();
  [[nodiscard]] const KvPool& pool() const { return *pool_; }

 private:
  TpFollowerWorker(std::unique_ptr<model::Engine> engine, comm::Communicator& comm, TpFollowerOptions options)
      : engine_(std::move(engine)), comm_(comm), options_(std::move(options)) {}
  // Arms the transport for `id`'s KV, re-arming after a failed attempt until `deadline`.
  void expectUntil(std::uint64_t id, kvtransfer::Deadline deadline);

  std::unique_ptr<model::Engine> engine_;
  comm::Communicator& comm_;
  TpFollowerOptions options_;
  std::unique_ptr<KvPool> pool_;
  std::unique_ptr<kvtransfer::Transport> transport_;
  kvtransfer::RegionId region_{};
  bool region_registered_ = false;
};

}  // namespace pd::decode
