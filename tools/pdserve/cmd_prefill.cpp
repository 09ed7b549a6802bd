// pdserve prefill: the prefill worker process (prefill::runWorker, pd/prefill/run_worker.h).
// Prints one PDSERVE_READY line on stdout when serving; SIGTERM / SIGINT drains and exits 0.
// --check-config validates the options and exits (0, or 2 on a bad value) without loading the model.
#include <string>
#include <string_view>
#include <vector>

#include "pd/kvtransfer/kvtransfer_config.h"
#include "pd/prefill/prefill_config.h"
#include "pd/prefill/run_worker.h"
#include "worker_command.h"

namespace pd::cli {
namespace {

constexpr std::string_view kUsage =
    "usage: pdserve prefill [--config FILE] [--check-config] [--section.name value ...]\n"
    "Runs a prefill worker: computes prompts' latent KV and streams it over UCX into decode workers' KV pools.\n"
    "Prints 'PDSERVE_READY role=prefill url=http://HOST:PORT' on stdout once serving. SIGTERM/SIGINT drains\n"
    "(prefill.drain_timeout_ms) and exits 0. --check-config validates the configuration and exits.";

}  // namespace

int runPrefill(const std::vector<std::string>& args) {
  prefill::PrefillWorkerConfig cfg;
  config::OptionSet prefill_set("prefill");
  config::OptionSet kv_set("kvtransfer");
  prefill::registerOptions(prefill_set, cfg.prefill);
  kvtransfer::registerOptions(kv_set, cfg.kvtransfer);
  return runWorkerCommand(
      WorkerRole{"prefill", kUsage, &prefill_set, &kv_set}, args, cfg,
      [](const prefill::PrefillWorkerConfig& c) { return prefill::validate(c); },
      [](const prefill::PrefillWorkerConfig& c) { return prefill::runWorker(c); });
}

}  // namespace pd::cli
