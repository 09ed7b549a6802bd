// pdserve prefill: the prefill worker process (issue 7). Loads the model, serves the internal
// API (docs/internal-api.md) through PrefillServer, prints one PDSERVE_READY line on stdout when
// serving, and drains on SIGTERM / SIGINT: /ready turns 503 and new prefills are refused at once,
// in-flight ones may finish for prefill.drain_timeout_ms, the rest are aborted (failure records
// to their decode workers), and the process exits 0. A second signal skips the wait.
// --check-config validates the options and exits (0, or 2 on a bad value) without loading the model.
#include <fmt/format.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <ctime>
#include <string_view>

#include "cli.h"
#include "pd/common/log.h"
#include "pd/common/model/engine.h"
#include "pd/kvtransfer/kvtransfer_config.h"
#include "pd/kvtransfer/ucx_transport.h"
#include "pd/prefill/model_hash.h"
#include "pd/prefill/prefill_config.h"
#include "pd/prefill/prefill_server.h"

namespace pd::cli {
namespace {

constexpr std::string_view kUsage =
    "usage: pdserve prefill [--config FILE] [--check-config] [--section.name value ...]\n"
    "Runs a prefill worker: computes prompts' latent KV and streams it over UCX into decode workers' KV pools.\n"
    "Prints 'PDSERVE_READY role=prefill url=http://HOST:PORT' on stdout once serving. SIGTERM/SIGINT drains\n"
    "(prefill.drain_timeout_ms) and exits 0. --check-config validates the configuration and exits.";

// Drains after the first signal; a second one (or the drain timeout) ends the wait.
void drain(prefill::PrefillServer& server, const sigset_t& signals, std::chrono::milliseconds timeout) {
  server.beginDrain();
  waitForDrain([&] { return server.waitIdle(std::chrono::milliseconds(50)); }, signals, timeout, "prefill",
               [] { return std::string("what is left"); });
}

}  // namespace

int runPrefill(const std::vector<std::string>& raw_args) {
  std::vector<std::string> args = raw_args;
  const bool check_only = takeCheckConfigFlag(args);
  CommonConfig common;
  CommonOptions common_sets(common);
  prefill::PrefillConfig prefill_cfg;
  kvtransfer::KvTransferConfig kv_cfg;
  config::OptionSet prefill_set("prefill");
  config::OptionSet kv_set("kvtransfer");
  prefill::registerOptions(prefill_set, prefill_cfg);
  kvtransfer::registerOptions(kv_set, kv_cfg);
  auto loaded = loadCommandOptions(std::string(kUsage), {&prefill_set, &kv_set, &common_sets.log, &common_sets.model},
                                   args, &common);
  if (!loaded.ok()) return reportFailure(loaded.error());
  if (loaded->help_requested) return 0;
  if (!loaded->positionals.empty()) {
    return reportFailure(
        makeError(ErrorCode::InvalidArgument, fmt::format("unexpected argument '{}'", loaded->positionals.front())));
  }
  if (Status s = kvtransfer::validate(kv_cfg); !s.ok()) return reportFailure(s.error());
  if (check_only) return 0;

  // Signals are taken by sigwait on this thread: block them before any other thread exists.
  const sigset_t signals = blockStopSignals();

  for (const auto* set : {&prefill_set, &kv_set}) {
    for (const std::string& v : set->describeValues()) log::info("prefill", "{}.{}", set->section(), v);
  }
  auto model_dir = resolveModelDir(common);
  if (!model_dir.ok()) return reportFailure(model_dir.error());
  auto hash = prefill::modelHash(*model_dir);
  if (!hash.ok()) return reportFailure(hash.error());
  model::CpuEngineOptions engine_options;
  engine_options.threads = static_cast<int>(prefill_cfg.threads);
  auto engine = model::createCpuEngine(*model_dir, engine_options);
  if (!engine.ok()) return reportFailure(engine.error());
  log::info("prefill", "model {} loaded ({}), hash {}", model_dir->string(), (*engine)->capabilities().backend,
            prefill::modelHashHex(*hash));

  prefill::PrefillServerOptions options;
  options.prefill = prefill_cfg;
  options.kvtransfer = kv_cfg;
  options.model_hash = *hash;
  auto server = prefill::PrefillServer::start(std::move(engine).value(), options);
  if (!server.ok()) return reportFailure(server.error());
  std::printf("PDSERVE_READY role=prefill url=%s\n", (*server)->url().c_str());
  std::fflush(stdout);

  int sig = 0;
  if (sigwait(&signals, &sig) == 0) log::info("prefill", "signal {}: draining", sig);
  drain(**server, signals, std::chrono::milliseconds(prefill_cfg.drain_timeout_ms));
  (*server)->stop();
  log::info("prefill", "stopped");
  return 0;
}

}  // namespace pd::cli
