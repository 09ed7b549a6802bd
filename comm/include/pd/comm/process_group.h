#pragma once
/// The rank process group of a tensor-parallel worker (docs/tensor-parallel.md): this process's
/// rank of a group plus the ranks it spawns on this machine (`pdserve <role> ... --<role>.tp_rank
/// r`, i.e. its own command line plus that flag, and `--<role>.tp_group NAME` on one machine),
/// joined in a communicator: shared memory (shm_communicator.h) when the whole group is on this
/// machine, TCP around rank 0 (tcp_communicator.h) when a rendezvous address is given (several
/// nodes). Rank 0 is the leader; across nodes, node n's process is rank n * local_ranks and spawns
/// the next local_ranks - 1 ranks.
///
/// Thread rules: driven by one thread (the process's main thread); checkLocalRanks() and
/// pollLocalRanks() may be called from another thread.

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "pd/comm/communicator.h"
#include "pd/common/result.h"
#include "pd/common/subprocess.h"

namespace pd::comm {

struct TpGroupOptions {
  int size = 2;  ///< ranks in the whole group
  /// This process's rank: 0 (the leader) or, across nodes, the first rank of its node.
  int rank = 0;
  /// Ranks on this machine, this process included (it spawns rank+1 .. rank+local_ranks-1);
  /// 0 = size (the whole group here).
  int local_ranks = 0;
  /// The spawned ranks' command line (argv[0] = the pdserve executable); each gets
  /// `--<section>.tp_rank r` appended, plus `--<section>.tp_group NAME` for a shm group.
  std::vector<std::string> child_argv;
  std::string section = "decode";
  /// Empty: shm group (the whole group on this machine). Otherwise rank 0's host:port: a TCP group
  /// (TcpOptions::address); the spawned ranks find it in their own command line.
  std::string dist_init_address;
  std::uint64_t group_key = 0;                     ///< TcpOptions::group_key (e.g. the model hash)
  std::chrono::milliseconds join_timeout{600000};  ///< model loading included
  /// TEST-ONLY ShmOptions::inject_latency of this process's communicator (0 = off; shm only).
  std::chrono::microseconds inject_latency{0};
  /// TCP, rank 0: called with the port it listens on (tests pass port 0).
  std::function<void(int port)> on_listening;
};

class TpProcessGroup {
 public:
  /// Spawns the local ranks and waits up to `join_timeout` until the whole group joined. A spawned
  /// rank that exits before joining fails start() at once with PeerFailed. The children get
  /// SIGKILL if this process dies.
  static Result<std::unique_ptr<TpProcessGroup>> start(TpGroupOptions options);
  /// Waits up to 10 s for the spawned ranks to exit (stop the group first), then kills them.
  ~TpProcessGroup();
  TpProcessGroup(const TpProcessGroup&) = delete;
  TpProcessGroup& operator=(const TpProcessGroup&) = delete;

  [[nodiscard]] Communicator& comm() { return *comm_; }
  /// "shm NAME" or "tcp HOST:PORT".
  [[nodiscard]] const std::string& describe() const { return description_; }
  /// Spawned ranks' exit statuses so far (nullopt: still running), in rank order.
  std::vector<std::optional<int>> pollLocalRanks();
  /// PeerFailed naming the first spawned rank that exited, else OK.
  Status checkLocalRanks();

 private:
  TpProcessGroup() = default;
  std::string description_;
  int first_child_rank_ = 1;
  std::vector<std::unique_ptr<proc::Subprocess>> children_;
  std::unique_ptr<Communicator> comm_;
};

}  // namespace pd::comm
