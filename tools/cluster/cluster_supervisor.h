#pragma once
/// The supervisor behind `pdserve up`: one local cluster (decode workers, prefill workers, one
/// router) as child processes of this one, each a proc::RoleProcess running this binary with its
/// role. Their log lines come out here prefixed with the child's name; each child's READY line
/// becomes a `PDSERVE_CHILD name=N pid=P url=U` line on stdout.
///
/// It heals: a worker that exits is started again on the same port (so the router's static
/// worker list finds it once its health polling sees it ready) after an exponential backoff,
/// within a restart budget per worker. Meanwhile the router serves with the workers left. Only the
/// router's own exit, a worker that spent its budget, or a stop request ends the cluster.
///
/// Thread rules: one owner thread (the command's main thread) calls everything; `stop_requested`
/// may be set from a signal handler. The children's output is forwarded by their reader threads.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "pd/common/result.h"
#include "pd/common/role_process.h"

namespace pd::cluster {

/// When and how often an exited worker is started again.
struct RestartPolicy {
  std::chrono::milliseconds backoff_initial{500};  ///< before the first restart
  std::chrono::milliseconds backoff_max{10000};    ///< the backoff doubles up to this
  std::int64_t budget = 5;                         ///< restarts per worker within `window`; 0: never restart
  std::chrono::milliseconds window{600000};
};

/// The delay before restart number `recent + 1` of a worker that restarted `recent` times within
/// the window: backoff_initial doubled `recent` times, at most backoff_max.
[[nodiscard]] std::chrono::milliseconds restartDelay(const RestartPolicy& policy, std::size_t recent);

struct ClusterOptions {
  std::string executable;                 ///< this binary
  std::vector<std::string> common_flags;  ///< every child's flags after its role (e.g. --config FILE)
  std::int64_t prefill_workers = 1;
  std::int64_t decode_workers = 1;
  std::vector<std::string> prefill_flags;  ///< each prefill worker's own flags, after the common ones
  std::vector<std::string> decode_flags;   ///< each decode worker's own flags, after the common ones
  std::vector<std::string> router_flags;   ///< the router's own flags (its worker lists are added)
  std::chrono::milliseconds ready_timeout{600000};
  std::chrono::milliseconds stop_timeout{40000};
  RestartPolicy restart;
};

class ClusterSupervisor {
 public:
  /// `stop_requested` (set by the command's signal handler) and `wake_fd` (readable when it was
  /// set; -1 for none) end waits early.
  ClusterSupervisor(ClusterOptions options, const std::atomic<int>& stop_requested, int wake_fd);
  /// Kills what is still running.
  ~ClusterSupervisor();
  ClusterSupervisor(const ClusterSupervisor&) = delete;
  ClusterSupervisor& operator=(const ClusterSupervisor&) = delete;
  ClusterSupervisor(ClusterSupervisor&&) = delete;
  ClusterSupervisor& operator=(ClusterSupervisor&&) = delete;

  /// Starts the workers, then the router with their addresses, and waits until the router's
  /// /ready answers 200; returns the router's url. Any exit while starting fails it (PeerFailed),
  /// as do a stop request (Cancelled) and ready_timeout (Timeout).
  [[nodiscard]] Result<std::string> start();
  /// Supervises until a stop request (ok) or until the router exited or a worker spent its
  /// restart budget (PeerFailed). Does not stop the children: call stopAll().
  [[nodiscard]] Status superviseUntilStopped();
  /// Stops in order: the router first (it drains), then the prefill workers, then the decode
  /// workers; each group gets stop_timeout before SIGKILL.
  void stopAll();

 private:
  struct Child {
    std::string name;                            // "router", "prefill-0", "decode-1"
    std::vector<std::string> args;               // role and flags (without the executable)
    std::string port_flag;                       // "--prefill.port" for a restartable worker; empty for the router
    std::unique_ptr<proc::RoleProcess> process;  // null while waiting to restart
    bool announced = false;                      // its PDSERVE_CHILD line is out
    std::chrono::steady_clock::time_point ready_deadline;
    std::chrono::steady_clock::time_point restart_at;
    std::deque<std::chrono::steady_clock::time_point> restarts;  // within the window
    std::uint16_t port = 0;                                      // pinned after its first READY line
  };

  Status spawn(Child& child);
  // Prints its PDSERVE_CHILD line (and pins a worker's port) once it printed its READY line.
  void announceIfReady(Child& child);
  // Announces children that became ready; PeerFailed naming the first one that exited.
  Status checkStarting();
  Status waitAllReady(const std::vector<Child*>& children);
  Status waitRouterReady(const std::string& url);
  // One supervision step for a worker that exited or did not become ready in time.
  Status scheduleRestart(Child& child, const std::string& why);
  void stopGroup(const std::string& prefix);
  // Waits up to `timeout` for the wake fd; true when a stop was requested.
  bool sleepFor(std::chrono::milliseconds timeout);

  ClusterOptions options_;
  const std::atomic<int>& stop_requested_;
  int wake_fd_;
  std::vector<std::unique_ptr<Child>> children_;
};

}  // namespace pd::cluster
