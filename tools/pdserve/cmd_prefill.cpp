// pdserve prefill: the prefill worker process. Loads the model, serves the internal
// API (docs/internal-api.md) through PrefillServer, prints one PDSERVE_READY line on stdout when
// serving, and drains on SIGTERM / SIGINT: /ready turns 503 and new prefills are refused at once,
// in-flight ones may finish for prefill.drain_timeout_ms, the rest are aborted (failure records
// to their decode workers), and the process exits 0. A second signal skips the wait.
// --check-config validates the options and exits (0, or 2 on a bad value) without loading the model.
//
// Tensor parallelism (docs/tensor-parallel.md): with prefill.tensor_parallel N > 1 this process is
// rank 0: it spawns ranks 1..N-1 (its own command line plus --prefill.tp_rank r --prefill.tp_group
// NAME) joined over shared memory, wraps its shard in a model::TpLeaderEngine and serves; every forward
// runs sharded on all ranks, and rank 0's sink streams the latent KV (MLA's latent is replicated,
// so rank 0 has all of it). A spawned rank prints no READY line, ignores SIGTERM / SIGINT and
// exits 0 when rank 0 stops the group (1 when the group failed). A rank that exits breaks the
// group: prefills fail with PeerFailed (the router retries elsewhere) and /ready answers 503.
#include <fmt/format.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <functional>
#include <memory>
#include <string_view>

#include "cli.h"
#include "pd/comm/process_group.h"
#include "pd/comm/shm_communicator.h"
#include "pd/common/log.h"
#include "pd/common/subprocess.h"
#include "pd/decode/tp_worker.h"
#include "pd/engine/engine.h"
#include "pd/engine/model_hash.h"
#include "pd/engine/tp_engine.h"
#include "pd/kvtransfer/kvtransfer_config.h"
#include "pd/kvtransfer/ucx_transport.h"
#include "pd/prefill/prefill_config.h"
#include "pd/prefill/prefill_server.h"
#include "serving_engine.h"

namespace pd::cli {
namespace {

constexpr std::string_view kUsage =
    "usage: pdserve prefill [--config FILE] [--check-config] [--section.name value ...]\n"
    "Runs a prefill worker: computes prompts' latent KV and streams it over UCX into decode workers' KV pools.\n"
    "Prints 'PDSERVE_READY role=prefill url=http://HOST:PORT' on stdout once serving. SIGTERM/SIGINT drains\n"
    "(prefill.drain_timeout_ms) and exits 0. --check-config validates the configuration and exits.";

// Checks what the option tables alone cannot.
Status validate(const prefill::PrefillConfig& pre, const kvtransfer::KvTransferConfig& kv) {
  PD_TRY(kvtransfer::validate(kv));
  if (pre.tp_rank >= pre.tensor_parallel) {
    return makeError(
        ErrorCode::InvalidArgument,
        fmt::format("prefill.tp_rank {} must be below prefill.tensor_parallel {}", pre.tp_rank, pre.tensor_parallel));
  }
  if (pre.tp_rank > 0 && pre.tp_group.empty()) {
    return makeError(ErrorCode::InvalidArgument,
                     "prefill.tp_rank > 0 (a spawned tensor-parallel rank) needs prefill.tp_group; such ranks are "
                     "started by rank 0 (prefill.tensor_parallel > 1), not by hand");
  }
  return okStatus();
}

constexpr auto kTpJoinTimeout = std::chrono::minutes(10);  // model loading included

// The body of a spawned rank: joins rank 0's group, loads its shard and runs rank 0's forwards
// on a cache of its own until rank 0 stops the group.
int runSpawnedRank(const prefill::PrefillConfig& pre, const std::filesystem::path& model_dir) {
  comm::ShmOptions so;
  so.name = pre.tp_group;
  so.rank = static_cast<int>(pre.tp_rank);
  so.size = static_cast<int>(pre.tensor_parallel);
  so.join_timeout = kTpJoinTimeout;
  auto comm = comm::createShmCommunicator(so);
  if (!comm.ok()) return reportFailure(comm.error());
  model::CpuEngineOptions engine_options;
  engine_options.threads = static_cast<int>(pre.threads);
  engine_options.tp = comm->get();
  auto engine = model::createCpuEngine(model_dir, engine_options);
  if (!engine.ok()) return reportFailure(engine.error());
  log::info("prefill", "tensor-parallel rank {} of {} serving", pre.tp_rank, pre.tensor_parallel);
  const Status s = model::runTpFollower(**engine, **comm, model::ownedTpCache());
  if (!s.ok()) {
    log::error("prefill", "tensor-parallel rank {}: {}", pre.tp_rank, s.error().toString());
    return 1;
  }
  log::info("prefill", "tensor-parallel rank {} stopped", pre.tp_rank);
  return 0;
}

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
  if (Status s = validate(prefill_cfg, kv_cfg); !s.ok()) return reportFailure(s.error());
  if (check_only) return 0;

  // Signals are taken by sigwait on this thread: block them before any other thread exists.
  const sigset_t signals = blockStopSignals();

  for (const auto* set : {&prefill_set, &kv_set}) {
    for (const std::string& v : set->describeValues()) log::info("prefill", "{}.{}", set->section(), v);
  }
  auto model_dir = resolveModelDir(common);
  if (!model_dir.ok()) return reportFailure(model_dir.error());
  auto hash = pd::modelHash(*model_dir);
  if (!hash.ok()) return reportFailure(hash.error());
  if (prefill_cfg.tp_rank > 0) return runSpawnedRank(prefill_cfg, *model_dir);

  std::unique_ptr<comm::TpProcessGroup> group;
  if (prefill_cfg.tensor_parallel > 1) {
    auto self = proc::selfExecutable();
    if (!self.ok()) return reportFailure(self.error());
    comm::TpGroupOptions o;
    o.size = static_cast<int>(prefill_cfg.tensor_parallel);
    o.child_argv = {*self, "prefill"};
    o.child_argv.insert(o.child_argv.end(), args.begin(), args.end());  // --check-config already removed
    o.section = "prefill";
    o.join_timeout = kTpJoinTimeout;
    auto started = comm::TpProcessGroup::start(std::move(o));
    if (!started.ok()) return reportFailure(started.error());
    group = std::move(started).value();
    log::info("prefill", "tensor-parallel group of {} ranks joined ({})", prefill_cfg.tensor_parallel,
              group->describe());
  }
  auto loaded_engine = loadServingEngine(*model_dir, static_cast<int>(prefill_cfg.threads), group.get());
  if (!loaded_engine.ok()) return reportFailure(loaded_engine.error());
  std::unique_ptr<model::Engine> serving = std::move(loaded_engine->engine);
  model::TpLeaderEngine* const tp_leader = loaded_engine->tp_leader;
  log::info("prefill", "model {} loaded ({}), hash {}", model_dir->string(), serving->capabilities().backend,
            pd::modelHashHex(*hash));

  prefill::PrefillServerOptions options;
  options.prefill = prefill_cfg;
  options.kvtransfer = kv_cfg;
  options.model_hash = *hash;
  if (tp_leader != nullptr) options.broken = [tp_leader] { return tp_leader->broken(); };
  // The server owns the engine (and so the model::TpLeaderEngine); `group` outlives it (declared first).
  auto server = prefill::PrefillServer::start(std::move(serving), options);
  if (!server.ok()) return reportFailure(server.error());
  std::printf("PDSERVE_READY role=prefill url=%s\n", (*server)->url().c_str());
  std::fflush(stdout);

  std::function<Status()> watch;
  if (group) watch = [&group] { return group->checkLocalRanks(); };
  const int sig = waitForSignalWatching(signals, watch, [tp_leader](const Error& e) {
    log::error("prefill", "{}: the group is broken; prefills fail and /ready answers 503", e.toString());
    tp_leader->markBroken(e);
  });
  log::info("prefill", "signal {}: draining", sig);
  drain(**server, signals, std::chrono::milliseconds(prefill_cfg.drain_timeout_ms));
  (*server)->stop();
  if (tp_leader != nullptr) {
    // Tells the spawned ranks to return (they exit 0); ~TpProcessGroup then reaps them.
    if (Status s = tp_leader->stop(); !s.ok())
      log::warn("prefill", "stopping the other ranks: {}", s.error().toString());
  }
  (*server).reset();
  group.reset();
  log::info("prefill", "stopped");
  return 0;
}

}  // namespace pd::cli
