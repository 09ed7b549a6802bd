// pdserve prefill: the prefill worker process (prefill::runWorker, pd/prefill/run_worker.h).
// Prints one PDSERVE_READY line on stdout when serving; SIGTERM / SIGINT drains and exits 0.
// --check-config validates the options and exits (0, or 2 on a bad value) without loading the model.
#include <fmt/format.h>

#include <cstdio>
#include <string_view>

#include "cli.h"
#include "pd/common/log.h"
#include "pd/common/subprocess.h"
#include "pd/kvtransfer/kvtransfer_config.h"
#include "pd/prefill/prefill_config.h"
#include "pd/prefill/run_worker.h"

namespace pd::cli {
namespace {

constexpr std::string_view kUsage =
    "usage: pdserve prefill [--config FILE] [--check-config] [--section.name value ...]\n"
    "Runs a prefill worker: computes prompts' latent KV and streams it over UCX into decode workers' KV pools.\n"
    "Prints 'PDSERVE_READY role=prefill url=http://HOST:PORT' on stdout once serving. SIGTERM/SIGINT drains\n"
    "(prefill.drain_timeout_ms) and exits 0. --check-config validates the configuration and exits.";

}  // namespace

int runPrefill(const std::vector<std::string>& raw_args) {
  std::vector<std::string> args = raw_args;
  const bool check_only = takeCheckConfigFlag(args);
  CommonConfig common;
  CommonOptions common_sets(common);
  prefill::PrefillWorkerConfig cfg;
  config::OptionSet prefill_set("prefill");
  config::OptionSet kv_set("kvtransfer");
  prefill::registerOptions(prefill_set, cfg.prefill);
  kvtransfer::registerOptions(kv_set, cfg.kvtransfer);
  auto loaded = loadCommandOptions(
      std::string(kUsage),
      {&prefill_set, &kv_set, &common_sets.log, &common_sets.model, &common_sets.cluster, &common_sets.trace}, args,
      &common);
  if (!loaded.ok()) return reportFailure(loaded.error());
  if (loaded->help_requested) return 0;
  if (!loaded->positionals.empty()) {
    return reportFailure(
        makeError(ErrorCode::InvalidArgument, fmt::format("unexpected argument '{}'", loaded->positionals.front())));
  }
  auto self = proc::selfExecutable();
  if (!self.ok()) return reportFailure(self.error());
  cfg.rank_argv = {*self, "prefill"};
  cfg.rank_argv.insert(cfg.rank_argv.end(), args.begin(), args.end());  // --check-config already removed
  cfg.trace = common.trace;
  if (Status s = prefill::validate(cfg); !s.ok()) return reportFailure(s.error());
  if (check_only) return 0;

  for (const auto* set : {&prefill_set, &kv_set}) {
    for (const std::string& v : set->describeValues()) log::info("prefill", "{}.{}", set->section(), v);
  }
  auto model_dir = resolveModelDir(common);
  if (!model_dir.ok()) return reportFailure(model_dir.error());
  cfg.model_dir = *model_dir;
  cfg.on_ready = printReadyLine;
  cfg.cluster_secret_file = common.cluster_secret_file;
  if (Status s = prefill::runWorker(cfg); !s.ok()) return reportFailure(s.error());
  return 0;
}

}  // namespace pd::cli
