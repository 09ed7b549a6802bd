#pragma once
/// The one path of the worker role commands (`pdserve prefill`, `pdserve decode`): flags (with
/// --check-config), the role's and kvtransfer's sections, the rank argv the worker's tensor-
/// parallel ranks are started with, the role's validate(), the settings logged, the model folder,
/// then the role's runWorker().
/// Thread rules: main thread only, before any other thread exists (runWorker's rule).

#include <fmt/format.h>

#include <string>
#include <string_view>
#include <vector>

#include "cli.h"
#include "pd/common/log.h"
#include "pd/common/subprocess.h"
#include "pd/engine/gpu.h"

namespace pd::cli {

/// A worker role as its command sees it.
struct WorkerRole {
  std::string_view name;  ///< "prefill" or "decode": the subcommand, the log tag
  std::string_view usage;
  config::OptionSet* role_set;  ///< the role's section, bound to the worker config
  config::OptionSet* kv_set;    ///< kvtransfer's section, bound to the worker config
};

/// Runs a worker command: `validate(cfg)` and `run(cfg)` are the role's (WorkerConfig has
/// rank_argv, model_dir, on_ready and cluster_secret_file). The exit code: 0, 2 for bad input,
/// 1 for other failures.
template <class WorkerConfig, class Validate, class Run>
int runWorkerCommand(const WorkerRole& role, const std::vector<std::string>& raw_args, WorkerConfig& cfg,
                     Validate&& validate, Run&& run) {
  std::vector<std::string> args = raw_args;
  const bool check_only = takeCheckConfigFlag(args);
  CommonConfig common;
  CommonOptions common_sets(common);
  auto loaded = loadCommandOptions(
      std::string(role.usage),
      {role.role_set, role.kv_set, &common_sets.log, &common_sets.model, &common_sets.cluster, &common_sets.trace},
      args, &common);
  if (!loaded.ok()) return reportFailure(loaded.error());
  if (loaded->help_requested) return 0;
  if (!loaded->positionals.empty()) {
    return reportFailure(
        makeError(ErrorCode::InvalidArgument, fmt::format("unexpected argument '{}'", loaded->positionals.front())));
  }
  auto self = proc::selfExecutable();
  if (!self.ok()) return reportFailure(self.error());
  cfg.rank_argv = {*self, std::string(role.name)};
  cfg.rank_argv.insert(cfg.rank_argv.end(), args.begin(), args.end());  // --check-config already removed
  cfg.trace = common.trace;
  auto device = gpu::parseModelDevice(common.model_device);
  if (!device.ok()) return reportFailure(device.error());
  cfg.model_device = *device;
  cfg.batch_invariant = common.batch_invariant;
  auto numerics = gpu::parseNumerics(common.model_numerics);
  if (!numerics.ok()) return reportFailure(numerics.error());
  cfg.numerics = *numerics;
  cfg.cuda_graphs = common.cuda_graphs;
  if constexpr (requires { cfg.gpu_memory_utilization; }) cfg.gpu_memory_utilization = common.gpu_memory_utilization;
  if (Status s = validate(cfg); !s.ok()) return reportFailure(s.error());
  if (Status s = checkGpuOptions(common); !s.ok()) return reportFailure(s.error());
  if (check_only) return 0;
  if (Status s = checkModelDevice(common); !s.ok()) return reportFailure(s.error());

  for (const auto* set : {role.role_set, role.kv_set}) {
    for (const std::string& v : set->describeValues()) log::info(role.name, "{}.{}", set->section(), v);
  }
  auto model_dir = resolveModelDir(common);
  if (!model_dir.ok()) return reportFailure(model_dir.error());
  cfg.model_dir = *model_dir;
  cfg.tokenizer_dir = common.tokenizer_path;
  cfg.on_ready = printReadyLine;
  cfg.cluster_secret_file = common.cluster_secret_file;
  if (Status s = run(cfg); !s.ok()) return reportFailure(s.error());
  return 0;
}

}  // namespace pd::cli
