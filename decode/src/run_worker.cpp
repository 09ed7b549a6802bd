// The decode worker process: rank bootstrapping, the node-follower probe server, serving and
// drain (run_worker.h).
#include "pd/decode/run_worker.h"

#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <utility>

#include "pd/comm/nccl_bootstrap.h"
#include "pd/comm/process_group.h"
#include "pd/comm/shm_communicator.h"
#include "pd/comm/tcp_communicator.h"
#include "pd/common/http_server.h"
#include "pd/common/log.h"
#include "pd/common/probe_routes.h"
#include "pd/common/stop_signals.h"
#include "pd/decode/decode_server.h"
#include "pd/decode/tp_worker.h"
#include "pd/engine/engine.h"
#include "pd/engine/model_hash.h"
#include "pd/engine/serving_engine.h"
#include "pd/engine/tp_engine.h"
#include "pd/structured/worker_grammars.h"

namespace pd::decode {
namespace {

constexpr std::string_view kLog = "decode";
constexpr auto kTpJoinTimeout = std::chrono::minutes(10);  // model loading included

int ranksPerNode(const DecodeConfig& dec) {
  return static_cast<int>(dec.tensor_parallel / dec.nnodes);
}

// With --model.device cuda, every rank of the group joins the NCCL communicator over the group
// (rank 0 makes the id); nullptr on CPU or for a single rank.
Result<std::unique_ptr<comm::Communicator>> joinDeviceGroup(comm::Communicator& group, const DecodeWorkerConfig& cfg,
                                                            std::uint64_t hash) {
  const int local_rank = group.rank() % ranksPerNode(cfg.decode);
  PD_ASSIGN_OR_RETURN(auto device_group, comm::joinDeviceGroup(group, gpu::cudaIndexOrNone(cfg.model_device),
                                                               local_rank, hash, kTpJoinTimeout));
  if (device_group) {
    log::info(kLog, "tensor-parallel rank {} of {}: NCCL communicator on cuda:{}", group.rank(), group.size(),
              gpu::cudaIndexOrNone(cfg.model_device) + local_rank);
  }
  return device_group;
}

// Loads this rank's shard and serves the leader's calls until it stops the group (ok) or the
// group fails. `serving` (may be empty) is told once the rank serves and when it stops.
Status serveAsFollower(comm::Communicator& comm, const DecodeWorkerConfig& cfg, std::uint64_t hash,
                       const std::function<void(bool)>& serving = {}) {
  PD_ASSIGN_OR_RETURN(const std::unique_ptr<comm::Communicator> device_group, joinDeviceGroup(comm, cfg, hash));
  // The rank's shard on its own GPU (index + local rank) with --model.device cuda.
  gpu::ModelDevice device = cfg.model_device;
  if (device.kind == gpu::ModelDevice::Kind::Cuda) device.index += comm.rank() % ranksPerNode(cfg.decode);
  PD_ASSIGN_OR_RETURN(auto engine,
                      model::loadRankEngine(cfg.model_dir, static_cast<int>(cfg.decode.threads), &comm, device,
                                            cfg.batch_invariant, cfg.numerics, cfg.cuda_graphs, device_group.get()));
  PD_ASSIGN_OR_RETURN(std::shared_ptr<InternalAuth> auth, loadInternalAuth(cfg.cluster_secret_file));
  PD_ASSIGN_OR_RETURN(auto worker,
                      TpFollowerWorker::start(std::move(engine), comm, {cfg.decode, cfg.kvtransfer, hash, auth}));
  log::info(kLog, "tensor-parallel rank {} of {} serving ({})", comm.rank(), comm.size(), comm.kind());
  if (serving) serving(true);
  Status s = worker->run();
  if (serving) serving(false);
  if (!s.ok()) {
    log::error(kLog, "tensor-parallel rank {}: {}", comm.rank(), s.error().toString());
    return s;
  }
  log::info(kLog, "tensor-parallel rank {} stopped", comm.rank());
  return okStatus();
}

// The body of a spawned rank (tp_rank > 0): joins its node's group (shm) or the TCP group.
Status runSpawnedRank(const DecodeWorkerConfig& cfg, std::uint64_t hash) {
  const DecodeConfig& dec = cfg.decode;
  Result<std::unique_ptr<comm::Communicator>> comm = makeError(ErrorCode::Internal, "no communicator");
  if (dec.dist_init_address.empty()) {
    comm::ShmOptions so;
    so.name = dec.tp_group;
    so.rank = static_cast<int>(dec.tp_rank);
    so.size = static_cast<int>(dec.tensor_parallel);
    so.join_timeout = kTpJoinTimeout;
    so.inject_latency = std::chrono::microseconds(dec.tp_inject_latency_us);
    comm = comm::createShmCommunicator(so);
  } else {
    comm::TcpOptions to;
    to.address = dec.dist_init_address;
    to.rank = static_cast<int>(dec.tp_rank);
    to.size = static_cast<int>(dec.tensor_parallel);
    to.group_key = hash;
    to.join_timeout = kTpJoinTimeout;
    comm = comm::createTcpCommunicator(to);
  }
  if (!comm.ok()) return comm.error();
  return serveAsFollower(**comm, cfg, hash);
}

// Spawns this node's other ranks and joins the whole group (the leader, or node n's process).
Result<std::unique_ptr<comm::TpProcessGroup>> startGroup(const DecodeWorkerConfig& cfg, std::uint64_t hash) {
  const DecodeConfig& dec = cfg.decode;
  comm::TpGroupOptions o;
  o.size = static_cast<int>(dec.tensor_parallel);
  o.rank = static_cast<int>(dec.node_rank) * ranksPerNode(dec);
  o.local_ranks = ranksPerNode(dec);
  o.child_argv = cfg.rank_argv;
  o.section = "decode";
  o.dist_init_address = dec.dist_init_address;
  o.group_key = hash;
  o.join_timeout = kTpJoinTimeout;
  o.inject_latency = std::chrono::microseconds(dec.tp_inject_latency_us);
  PD_ASSIGN_OR_RETURN(auto group, comm::TpProcessGroup::start(std::move(o)));
  log::info(kLog, "tensor-parallel group of {} ranks joined ({})", dec.tensor_parallel, group->describe());
  return group;
}

// Node n > 0 of a multi-node group: its ranks serve the leader; this process also answers the
// orchestrator's probes (/health; /ready while its rank serves) and /metrics on decode.port.
Status runNodeFollower(const DecodeWorkerConfig& cfg, std::uint64_t hash) {
  const DecodeConfig& dec = cfg.decode;
  PD_ASSIGN_OR_RETURN(auto group, startGroup(cfg, hash));
  auto serving = std::make_shared<std::atomic<bool>>(false);
  comm::TpProcessGroup* g = group.get();
  std::vector<http::Route> routes;
  http::Probes probes;
  probes.not_ready = [serving, g] {
    const bool ready = serving->load() && g->comm().checkPeers().ok();
    return ready ? std::string() : std::string("tensor-parallel group not serving");
  };
  probes.metrics = [serving, node_rank = dec.node_rank] {
    return fmt::format(
        "# HELP pdserve_decode_tp_rank_serving 1 while this node's ranks serve their tensor-parallel group\n"
        "# TYPE pdserve_decode_tp_rank_serving gauge\npdserve_decode_tp_rank_serving{{node_rank=\"{}\"}} {}\n",
        node_rank, serving->load() ? 1 : 0);
  };
  http::addProbeRoutes(routes, std::move(probes));
  http::ServerOptions so;
  so.host = dec.host;
  so.port = static_cast<std::uint16_t>(dec.port);
  so.io_threads = 1;
  PD_ASSIGN_OR_RETURN(auto server, http::Server::start(so, std::move(routes)));
  Status s = serveAsFollower(group->comm(), cfg, hash, [&](bool on) {
    serving->store(on);
    if (on && cfg.on_ready) {
      cfg.on_ready(
          fmt::format("role=decode-rank url=http://{}:{} node_rank={}", dec.host, server->port(), dec.node_rank));
    }
  });
  server->stop();
  group.reset();
  return s;
}

// Drains after the first signal; a second one (or the drain timeout) ends the wait.
void drain(DecodeServer& server, const sigset_t& signals, std::chrono::milliseconds timeout) {
  server.beginDrain();
  proc::waitForDrain([&] { return server.waitIdle(std::chrono::milliseconds(50)); }, signals, timeout, kLog,
                     [&] { return fmt::format("{} open stream(s)", server.openStreams()); });
}

// The vocabulary output constraints compile against; none (free text only, logged) when the
// tokenizer does not load or does not fit the model.
std::shared_ptr<const structured::WorkerGrammars> loadGrammars(const DecodeWorkerConfig& cfg, std::int64_t vocab_size) {
  const std::filesystem::path dir = cfg.tokenizer_dir.empty() ? cfg.model_dir : cfg.tokenizer_dir;
  auto grammars = structured::WorkerGrammars::load(dir, static_cast<std::size_t>(vocab_size));
  if (!grammars.ok()) {
    log::warn(kLog, "no output constraints (response_format, tool_choice): {}", grammars.error().toString());
    return nullptr;
  }
  return std::move(grammars).value();
}

}  // namespace

Status validate(const DecodeWorkerConfig& cfg) {
  PD_TRY(kvtransfer::validate(cfg.kvtransfer));
  PD_TRY(validate(cfg.decode));
  PD_TRY(trace::validate(cfg.trace));
  if (cfg.decode.tensor_parallel > 1 && cfg.rank_argv.empty()) {
    return makeError(ErrorCode::InvalidArgument, "decode.tensor_parallel > 1 needs the command line of a rank");
  }
  return okStatus();
}

namespace {

// With --model.device cuda, an automatic decode.num_blocks (0) becomes what
// model.gpu_memory_utilization leaves on the rank's GPU (model::planGpuKvPool). Every rank of a
// group computes the same plan (same model, same GPU type); a rank whose pool differed from the
// leader's would be refused at its first call (fixedTpCache).
Result<DecodeWorkerConfig> sizeGpuPool(const DecodeWorkerConfig& cfg, bool log_plan) {
  DecodeWorkerConfig out = cfg;
  if (cfg.model_device.kind != gpu::ModelDevice::Kind::Cuda || cfg.decode.num_blocks > 0) return out;
  PD_ASSIGN_OR_RETURN(const ModelConfig model, ModelConfig::load(cfg.model_dir));
  PD_ASSIGN_OR_RETURN(const std::uint64_t total, gpu::deviceTotalMemory(cfg.model_device.index));
  PD_ASSIGN_OR_RETURN(
      const model::GpuKvPoolSize size,
      model::planGpuKvPool(model, total, cfg.gpu_memory_utilization, static_cast<int>(cfg.decode.tensor_parallel),
                           cfg.decode.block_size, poolDtype(cfg.decode)));
  out.decode.num_blocks = size.num_blocks;
  if (log_plan) {
    log::info(kLog, "{} (model.gpu_memory_utilization; every rank's pool in its own GPU memory)", size.description);
  }
  return out;
}

Status runSizedWorker(const DecodeWorkerConfig& cfg);

}  // namespace

Status runWorker(const DecodeWorkerConfig& given) {
  PD_TRY(validate(given));
  // Before any rank spawns: every rank of this node runs on its own GPU, index + local rank.
  PD_TRY(gpu::checkModelDevices(given.model_device, ranksPerNode(given.decode)));
  PD_ASSIGN_OR_RETURN(const DecodeWorkerConfig sized,
                      sizeGpuPool(given, given.decode.tp_rank == 0 && given.decode.node_rank == 0));
  return runSizedWorker(sized);
}

namespace {

Status runSizedWorker(const DecodeWorkerConfig& cfg) {
  const DecodeConfig& dec = cfg.decode;
  const bool spawned = dec.tp_rank > 0;
  const bool leader = dec.tensor_parallel > 1 && !spawned && dec.node_rank == 0;
  const bool node_follower = !spawned && dec.node_rank > 0;

  // Signals are taken by sigwait on this thread: block them before any other thread exists. A
  // rank other than the leader never takes them (a terminal's SIGINT reaches the whole process
  // group): the leader stops it, or it dies with its parent.
  const sigset_t signals = proc::blockStopSignals();
  // The same hash the prefill workers compute (their descriptors and records must match ours).
  PD_ASSIGN_OR_RETURN(const std::uint64_t hash, modelHash(cfg.model_dir));
  if (spawned) return runSpawnedRank(cfg, hash);
  if (node_follower) return runNodeFollower(cfg, hash);

  // Leader: spawn and join the other ranks first (they load their shards meanwhile).
  std::unique_ptr<comm::TpProcessGroup> group;
  std::unique_ptr<comm::Communicator> device_group;  // over `group`: released before it
  if (leader) {
    PD_ASSIGN_OR_RETURN(group, startGroup(cfg, hash));
    PD_ASSIGN_OR_RETURN(device_group, joinDeviceGroup(group->comm(), cfg, hash));
  }
  PD_ASSIGN_OR_RETURN(
      model::ServingEngine loaded,
      model::loadServingEngine(cfg.model_dir, static_cast<int>(dec.threads), group.get(), cfg.model_device,
                               cfg.batch_invariant, cfg.numerics, cfg.cuda_graphs, device_group.get()));
  model::TpLeaderEngine* const tp_leader = loaded.tp_leader;
  log::info(kLog, "model {} loaded ({}), hash {}", cfg.model_dir.string(), loaded.engine->capabilities().backend,
            modelHashHex(hash));

  DecodeServerOptions options;
  PD_ASSIGN_OR_RETURN(options.auth, loadInternalAuth(cfg.cluster_secret_file));
  options.decode = dec;
  options.kvtransfer = cfg.kvtransfer;
  options.trace = cfg.trace;
  options.model_hash = hash;
  options.grammars = loadGrammars(cfg, loaded.engine->config().vocab_size);
  options.tp_leader = tp_leader;
  // The server owns the engine (and so the TpLeaderEngine); `group` outlives it (declared first).
  PD_ASSIGN_OR_RETURN(auto server, DecodeServer::start(std::move(loaded.engine), options));
  if (cfg.on_ready) cfg.on_ready("role=decode url=" + server->url());

  std::function<Status()> watch;
  if (group) {
    watch = [&group]() -> Status {
      PD_TRY(group->checkLocalRanks());
      return group->comm().checkPeers();
    };
  }
  const int sig = proc::waitForSignalWatching(signals, watch, [tp_leader](const Error& e) {
    log::error(kLog, "{}: the group is broken; requests fail and /ready answers 503", e.toString());
    tp_leader->markBroken(e);
  });
  log::info(kLog, "signal {}: draining", sig);
  drain(*server, signals, std::chrono::milliseconds(dec.drain_timeout_ms));
  server->stop(std::chrono::milliseconds(0));
  if (tp_leader != nullptr) {
    // Tells the followers to return (they exit 0); ~TpProcessGroup then reaps them.
    if (Status s = tp_leader->stop(); !s.ok()) log::warn(kLog, "stopping the followers: {}", s.error().toString());
  }
  server.reset();
  device_group.reset();
  group.reset();
  log::info(kLog, "stopped");
  return okStatus();
}

}  // namespace

}  // namespace pd::decode
