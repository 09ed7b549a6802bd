// pdserve decode: the decode worker process (decode::runWorker, pd/decode/run_worker.h), including
// the tensor-parallel ranks it spawns and the other nodes of a multi-node group. Prints one
// PDSERVE_READY line on stdout when serving; SIGTERM / SIGINT drains and exits 0.
// --check-config validates the options and exits (0, or 2 on a bad value) without loading the model.
#include <string>
#include <string_view>
#include <vector>

#include "pd/decode/decode_config.h"
#include "pd/decode/run_worker.h"
#include "pd/kvtransfer/kvtransfer_config.h"
#include "worker_command.h"

namespace pd::cli {
namespace {

constexpr std::string_view kUsage =
    "usage: pdserve decode [--config FILE] [--check-config] [--section.name value ...]\n"
    "Runs a decode worker: holds prompts' latent KV in a paged pool filled over UCX by prefill workers, runs\n"
    "batched decode steps (with MTP speculation) and streams tokens to the router.\n"
    "Prints 'PDSERVE_READY role=decode url=http://HOST:PORT' on stdout once serving. SIGTERM/SIGINT drains\n"
    "(decode.drain_timeout_ms) and exits 0. --check-config validates the configuration and exits.";

}  // namespace

int runDecode(const std::vector<std::string>& args) {
  decode::DecodeWorkerConfig cfg;
  config::OptionSet decode_set("decode");
  config::OptionSet kv_set("kvtransfer");
  decode::registerOptions(decode_set, cfg.decode);
  kvtransfer::registerOptions(kv_set, cfg.kvtransfer);
  return runWorkerCommand(
      WorkerRole{"decode", kUsage, &decode_set, &kv_set}, args, cfg,
      [](const decode::DecodeWorkerConfig& c) { return decode::validate(c); },
      [](const decode::DecodeWorkerConfig& c) { return decode::runWorker(c); });
}

}  // namespace pd::cli
