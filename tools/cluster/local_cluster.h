#pragma once
/// `pdserve up`: a whole local cluster (router + prefill + decode workers) on one machine, as
/// child processes of this one (ClusterSupervisor, cluster_supervisor.h). Every resolved setting
/// goes into one YAML file in a run folder (cache_dir/run/up-PID, removed on the way out) that
/// every child reads, so each child sees exactly what `up` validated; a fresh cluster secret is
/// written there when none is given. Ctrl-C / SIGTERM stops the router first (it drains), then the
/// workers.
///
/// Thread rules: main thread only; runLocalCluster installs SIGINT/SIGTERM handlers and ignores
/// SIGPIPE for the rest of the process.

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "pd/common/config.h"
#include "pd/common/result.h"

namespace pd::cluster {

/// `pdserve up` settings (section `up:`).
struct UpConfig {
  std::int64_t prefill_workers = 1;
  std::int64_t decode_workers = 1;
  std::int64_t ready_timeout_ms = 600000;
  std::int64_t stop_timeout_ms = 40000;
  std::int64_t restart_backoff_ms = 500;
  std::int64_t restart_backoff_max_ms = 10000;
  std::int64_t restart_budget = 5;
  std::int64_t restart_window_ms = 600000;
  bool smoke = false;
};
void registerUpOptions(config::OptionSet& set, UpConfig& cfg);

/// What the option tables cannot check: several workers of a role need that role's port 0.
[[nodiscard]] Status validateUpConfig(const UpConfig& cfg, std::int64_t prefill_port, std::int64_t decode_port);

/// The short flags `pdserve up` accepts (--model, --prefill, --decode, --tp, --port, --smoke,
/// --mtp, bare or with =VALUE) as the config's long names; other arguments unchanged.
[[nodiscard]] std::vector<std::string> expandUpAliases(const std::vector<std::string>& args);

/// One YAML file holding every value of `sets` (section: then `  name: "value"`, quotes and
/// backslashes escaped); Io when it cannot be written.
[[nodiscard]] Status writeResolvedConfig(const std::filesystem::path& file,
                                         const std::vector<const config::OptionSet*>& sets);

/// `pdserve up --device cuda`: every worker process shares the one GPU, so each gets an equal
/// part of model.gpu_memory_utilization (utilization / (prefill_workers + decode_workers)) as its
/// own; the router uses no GPU. InvalidArgument for a utilization outside (0, 1] or no worker.
struct GpuMemoryShares {
  double prefill = 0.0;  ///< each prefill worker's model.gpu_memory_utilization
  double decode = 0.0;   ///< each decode worker's
};
[[nodiscard]] Result<GpuMemoryShares> splitGpuMemory(double utilization, std::int64_t prefill_workers,
                                                     std::int64_t decode_workers);

struct LocalClusterConfig {
  UpConfig up;
  std::string executable;                     ///< the pdserve binary the children run
  std::filesystem::path model_dir;            ///< resolved; checked against its config before anything starts
  std::filesystem::path cache_dir;            ///< the run folder goes under cache_dir/run
  std::filesystem::path cluster_secret_file;  ///< empty: a fresh secret in the run folder
  std::string served_model_name;              ///< the smoke request's model
  /// The resolved sections every child reads (log, model, cluster, router, prefill, decode,
  /// kvtransfer), bound to values that outlive the call.
  std::vector<const config::OptionSet*> child_settings;
  /// model.device is a CUDA device: the workers share it, each with its splitGpuMemory() part.
  bool cuda = false;
  double gpu_memory_utilization = 0.9;  ///< the whole cluster's (model.gpu_memory_utilization)
};

/// Checks the checkpoint, starts the cluster, prints `PDSERVE_READY role=up url=URL` and then
/// either sends the smoke request (up.smoke) or serves until a signal, the router's exit or a
/// spent restart budget; stops every child. Errors before any child starts are returned; after
/// that the exit code: 0 after a signal or a good smoke answer, 1 otherwise (logged).
[[nodiscard]] Result<int> runLocalCluster(const LocalClusterConfig& cfg);

}  // namespace pd::cluster
