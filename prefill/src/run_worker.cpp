// The prefill worker process: rank bootstrapping, serving and drain (run_worker.h).
#include "pd/prefill/run_worker.h"

#include <chrono>
#include <functional>
#include <memory>

#include "pd/comm/nccl_bootstrap.h"
#include "pd/comm/process_group.h"
#include "pd/comm/shm_communicator.h"
#include "pd/common/log.h"
#include "pd/common/stop_signals.h"
#include "pd/engine/engine.h"
#include "pd/engine/model_hash.h"
#include "pd/engine/serving_engine.h"
#include "pd/engine/tp_engine.h"
#include "pd/prefill/prefill_server.h"
#include "pd/structured/worker_grammars.h"

namespace pd::prefill {
namespace {

constexpr std::string_view kLog = "prefill";
constexpr auto kTpJoinTimeout = std::chrono::minutes(10);  // model loading included

// The body of a spawned rank: joins rank 0's group, loads its shard and runs rank 0's forwards
// on a cache of its own until rank 0 stops the group.
Status runSpawnedRank(const PrefillWorkerConfig& cfg, std::uint64_t hash) {
  const PrefillConfig& pre = cfg.prefill;
  const int cuda_device = gpu::cudaIndexOrNone(cfg.model_device);
  comm::ShmOptions so;
  so.name = pre.tp_group;
  so.rank = static_cast<int>(pre.tp_rank);
  so.size = static_cast<int>(pre.tensor_parallel);
  so.join_timeout = kTpJoinTimeout;
  PD_ASSIGN_OR_RETURN(auto comm, comm::createShmCommunicator(so));
  // With --model.device cuda every rank also joins the NCCL communicator (docs/tensor-parallel.md).
  PD_ASSIGN_OR_RETURN(const auto device_group,
                      comm::joinDeviceGroup(*comm, cuda_device, comm->rank(), hash, kTpJoinTimeout));
  // The rank's shard on its own GPU (index + rank) with --model.device cuda.
  gpu::ModelDevice device = cfg.model_device;
  if (device.kind == gpu::ModelDevice::Kind::Cuda) device.index += comm->rank();
  Result<std::unique_ptr<model::Engine>> engine =
      model::loadRankEngine(cfg.model_dir, static_cast<int>(pre.threads), comm.get(), device, cfg.batch_invariant,
                            cfg.numerics, cfg.cuda_graphs, device_group.get());
  if (!engine.ok()) return engine.error();
  log::info(kLog, "tensor-parallel rank {} of {} serving", pre.tp_rank, pre.tensor_parallel);
  if (Status s = model::runTpFollower(**engine, *comm, model::engineTpCache(**engine)); !s.ok()) {
    log::error(kLog, "tensor-parallel rank {}: {}", pre.tp_rank, s.error().toString());
    return s;
  }
  log::info(kLog, "tensor-parallel rank {} stopped", pre.tp_rank);
  return okStatus();
}

// Drains after the first signal; a second one (or the drain timeout) ends the wait.
void drain(PrefillServer& server, const sigset_t& signals, std::chrono::milliseconds timeout) {
  server.beginDrain();
  proc::waitForDrain([&] { return server.waitIdle(std::chrono::milliseconds(50)); }, signals, timeout, kLog,
                     [] { return std::string("what is left"); });
}

// The vocabulary output constraints compile against; none (free text only, logged) when the
// tokenizer does not load or does not fit the model.
std::shared_ptr<const structured::WorkerGrammars> loadGrammars(const PrefillWorkerConfig& cfg,
                                                               std::int64_t vocab_size) {
  const std::filesystem::path dir = cfg.tokenizer_dir.empty() ? cfg.model_dir : cfg.tokenizer_dir;
  auto grammars = structured::WorkerGrammars::load(dir, static_cast<std::size_t>(vocab_size));
  if (!grammars.ok()) {
    log::warn(kLog, "no output constraints (response_format, tool_choice): {}", grammars.error().toString());
    return nullptr;
  }
  return std::move(grammars).value();
}

}  // namespace

Status validate(const PrefillWorkerConfig& cfg) {
  PD_TRY(kvtransfer::validate(cfg.kvtransfer));
  PD_TRY(validate(cfg.prefill));
  PD_TRY(trace::validate(cfg.trace));
  if (cfg.prefill.tensor_parallel > 1 && cfg.rank_argv.empty()) {
    return makeError(ErrorCode::InvalidArgument, "prefill.tensor_parallel > 1 needs the command line of a rank");
  }
  return okStatus();
}

Status runWorker(const PrefillWorkerConfig& cfg) {
  PD_TRY(validate(cfg));
  // Before any rank spawns: every rank runs on its own GPU, index + rank.
  PD_TRY(gpu::checkModelDevices(cfg.model_device, static_cast<int>(cfg.prefill.tensor_parallel)));
  const PrefillConfig& pre = cfg.prefill;
  // Signals are taken by sigwait on this thread: block them before any other thread exists.
  const sigset_t signals = proc::blockStopSignals();
  auto hash = modelHash(cfg.model_dir);
  if (!hash.ok()) return hash.error();
  if (pre.tp_rank > 0) {
    return runSpawnedRank(cfg, *hash);
  }

  std::unique_ptr<comm::TpProcessGroup> group;
  std::unique_ptr<comm::Communicator> device_group;  // over `group`: released before it
  if (pre.tensor_parallel > 1) {
    comm::TpGroupOptions o;
    o.size = static_cast<int>(pre.tensor_parallel);
    o.child_argv = cfg.rank_argv;
    o.section = "prefill";
    o.join_timeout = kTpJoinTimeout;
    PD_ASSIGN_OR_RETURN(group, comm::TpProcessGroup::start(std::move(o)));
    log::info(kLog, "tensor-parallel group of {} ranks joined ({})", pre.tensor_parallel, group->describe());
    // The NCCL communicator of a CUDA model (nullptr on CPU): the CUDA engine's collectives.
    PD_ASSIGN_OR_RETURN(device_group, comm::joinDeviceGroup(group->comm(), gpu::cudaIndexOrNone(cfg.model_device), 0,
                                                            *hash, kTpJoinTimeout));
  }
  PD_ASSIGN_OR_RETURN(
      model::ServingEngine loaded,
      model::loadServingEngine(cfg.model_dir, static_cast<int>(pre.threads), group.get(), cfg.model_device,
                               cfg.batch_invariant, cfg.numerics, cfg.cuda_graphs, device_group.get()));
  model::TpLeaderEngine* const tp_leader = loaded.tp_leader;
  if (cfg.batch_invariant && pre.kv_dtype == "f32") {
    log::info(kLog,
              "model.batch_invariant with prefill.kv_dtype f32: tokens are batch-invariant for F32 decode pools; "
              "for BF16 pools set prefill.kv_dtype bf16 (docs/configuration.md)");
  }
  log::info(kLog, "model {} loaded ({}), hash {}", cfg.model_dir.string(), loaded.engine->capabilities().backend,
            modelHashHex(*hash));

  PrefillServerOptions options;
  PD_ASSIGN_OR_RETURN(options.auth, loadInternalAuth(cfg.cluster_secret_file));
  options.prefill = pre;
  options.kvtransfer = cfg.kvtransfer;
  options.trace = cfg.trace;
  options.model_hash = *hash;
  options.grammars = loadGrammars(cfg, loaded.engine->config().vocab_size);
  if (tp_leader != nullptr) options.broken = [tp_leader] { return tp_leader->broken(); };
  // The server owns the engine (and so the TpLeaderEngine); `group` outlives it (declared first).
  PD_ASSIGN_OR_RETURN(auto server, PrefillServer::start(std::move(loaded.engine), options));
  if (cfg.on_ready) cfg.on_ready("role=prefill url=" + server->url());

  std::function<Status()> watch;
  if (group) watch = [&group] { return group->checkLocalRanks(); };
  const int sig = proc::waitForSignalWatching(signals, watch, [tp_leader](const Error& e) {
    log::error(kLog, "{}: the group is broken; prefills fail and /ready answers 503", e.toString());
    tp_leader->markBroken(e);
  });
  log::info(kLog, "signal {}: draining", sig);
  drain(*server, signals, std::chrono::milliseconds(pre.drain_timeout_ms));
  server->stop();
  if (tp_leader != nullptr) {
    // Tells the spawned ranks to return (they exit 0); ~TpProcessGroup then reaps them.
    if (Status s = tp_leader->stop(); !s.ok()) log::warn(kLog, "stopping the other ranks: {}", s.error().toString());
  }
  server.reset();
  device_group.reset();
  group.reset();
  log::info(kLog, "stopped");
  return okStatus();
}

}  // namespace pd::prefill
