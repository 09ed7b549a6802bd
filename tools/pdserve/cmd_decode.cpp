// pdserve decode: the decode worker process. Loads the model, serves the internal API
// (docs/internal-api.md) through DecodeServer, prints one PDSERVE_READY line on stdout when
// serving, and drains on SIGTERM / SIGINT: /ready turns 503 and new decode streams are refused
// at once (503 Overloaded), open streams may finish for decode.drain_timeout_ms, the rest are
// aborted (each ends with an error line; blocks freed, KV expectations cancelled), and the
// process exits 0. A second signal skips the wait.
// --check-config validates the options and exits (0, or 2 on a bad value) without loading the model.
//
// Tensor parallelism (docs/tensor-parallel.md): with decode.tensor_parallel N > 1 this process is
// rank 0, the leader: it spawns ranks 1..N-1 (its own command line plus --decode.tp_rank r
// --decode.tp_group NAME), serves the API and stops the followers when it stops. Across machines
// (decode.nnodes M > 1, decode.dist_init_address = node 0's host:port) node n's process is rank
// n*N/M, spawns the next N/M-1 ranks (its command line plus --decode.tp_rank r), joins the TCP group
// at the rendezvous and, on nodes > 0, serves only /health, /ready and /metrics on decode.port (its
// READY line says role=decode-rank). Every process but the leader prints no role=decode READY
// line, ignores SIGTERM / SIGINT (the leader's drain stops it; it dies with its parent) and exits 0
// once the leader stopped the group, 1 when the group failed. While serving, the leader watches
// the group: a rank that exits or whose connection drops breaks it (requests fail with
// PeerFailed, /ready answers 503).
#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cli.h"
#include "pd/comm/process_group.h"
#include "pd/comm/shm_communicator.h"
#include "pd/comm/tcp_communicator.h"
#include "pd/common/http_server.h"
#include "pd/common/log.h"
#include "pd/common/probe_routes.h"
#include "pd/common/subprocess.h"
#include "pd/decode/decode_config.h"
#include "pd/decode/decode_server.h"
#include "pd/decode/tp_worker.h"
#include "pd/engine/engine.h"
#include "pd/engine/model_hash.h"
#include "pd/engine/tp_engine.h"
#include "pd/kvtransfer/kvtransfer_config.h"
#include "pd/kvtransfer/ucx_transport.h"
#include "serving_engine.h"

namespace pd::cli {
namespace {

constexpr std::string_view kUsage =
    "usage: pdserve decode [--config FILE] [--check-config] [--section.name value ...]\n"
    "Runs a decode worker: holds prompts' latent KV in a paged pool filled over UCX by prefill workers, runs\n"
    "batched decode steps (with MTP speculation) and streams tokens to the router.\n"
    "Prints 'PDSERVE_READY role=decode url=http://HOST:PORT' on stdout once serving. SIGTERM/SIGINT drains\n"
    "(decode.drain_timeout_ms) and exits 0. --check-config validates the configuration and exits.";

// Checks what the option tables alone cannot: values that must agree with each other or with
// what this build can do.
Status validate(const decode::DecodeConfig& dec, const kvtransfer::KvTransferConfig& kv) {
  PD_TRY(kvtransfer::validate(kv));
  const auto bad = [](std::string message) { return makeError(ErrorCode::InvalidArgument, std::move(message)); };
  if (dec.tp_rank >= dec.tensor_parallel) {
    return bad(
        fmt::format("decode.tp_rank {} must be below decode.tensor_parallel {}", dec.tp_rank, dec.tensor_parallel));
  }
  if (dec.tensor_parallel % dec.nnodes != 0) {
    return bad(
        fmt::format("decode.tensor_parallel {} must be a multiple of decode.nnodes {} (the same ranks on "
                    "every node)",
                    dec.tensor_parallel, dec.nnodes));
  }
  if (dec.node_rank >= dec.nnodes) {
    return bad(fmt::format("decode.node_rank {} must be below decode.nnodes {}", dec.node_rank, dec.nnodes));
  }
  if (dec.nnodes > 1 && dec.dist_init_address.empty()) {
    return bad("decode.nnodes > 1 needs decode.dist_init_address (node 0's host:port)");
  }
  if (!dec.dist_init_address.empty()) {
    auto where = comm::parseHostPort(dec.dist_init_address);
    if (!where.ok()) return std::move(where).error();
    if (where->port == 0) return bad("decode.dist_init_address needs a port (the other nodes must know it)");
  }
  if (dec.tp_rank > 0 && dec.tp_group.empty() && dec.dist_init_address.empty()) {
    return bad(
        "decode.tp_rank > 0 (a spawned tensor-parallel rank) needs decode.tp_group or "
        "decode.dist_init_address; such ranks are started by their node's process "
        "(decode.tensor_parallel > 1), not by hand");
  }
  return okStatus();
}

constexpr auto kTpJoinTimeout = std::chrono::minutes(10);  // model loading included

int ranksPerNode(const decode::DecodeConfig& dec) {
  return static_cast<int>(dec.tensor_parallel / dec.nnodes);
}

// Loads this rank's shard and serves the leader's calls until it stops the group (exit 0) or the
// group fails (exit 1). `serving` (may be null) is told once the rank serves and when it stops.
int serveAsFollower(comm::Communicator& comm, const decode::DecodeConfig& dec, const kvtransfer::KvTransferConfig& kv,
                    const std::filesystem::path& model_dir, std::uint64_t hash,
                    const std::function<void(bool)>& serving = {}) {
  model::CpuEngineOptions engine_options;
  engine_options.threads = static_cast<int>(dec.threads);
  engine_options.tp = &comm;
  auto engine = model::createCpuEngine(model_dir, engine_options);
  if (!engine.ok()) return reportFailure(engine.error());
  auto worker = decode::TpFollowerWorker::start(std::move(engine).value(), comm, {dec, kv, hash});
  if (!worker.ok()) return reportFailure(worker.error());
  log::info("decode", "tensor-parallel rank {} of {} serving ({})", comm.rank(), comm.size(), comm.kind());
  if (serving) serving(true);
  const Status s = (*worker)->run();
  if (serving) serving(false);
  if (!s.ok()) {
    log::error("decode", "tensor-parallel rank {}: {}", comm.rank(), s.error().toString());
    return 1;
  }
  log::info("decode", "tensor-parallel rank {} stopped", comm.rank());
  return 0;
}

// The body of a spawned rank (tp_rank > 0): joins its node's group (shm) or the TCP group.
int runSpawnedRank(const decode::DecodeConfig& dec, const kvtransfer::KvTransferConfig& kv,
                   const std::filesystem::path& model_dir, std::uint64_t hash) {
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
  if (!comm.ok()) return reportFailure(comm.error());
  return serveAsFollower(**comm, dec, kv, model_dir, hash);
}

// Spawns this node's other ranks and joins the whole group (the leader, or node n's process).
Result<std::unique_ptr<comm::TpProcessGroup>> startGroup(const decode::DecodeConfig& dec,
                                                         const std::vector<std::string>& args, std::uint64_t hash) {
  PD_ASSIGN_OR_RETURN(std::string self, proc::selfExecutable());
  std::vector<std::string> argv{std::move(self), "decode"};
  argv.insert(argv.end(), args.begin(), args.end());  // --check-config already removed
  comm::TpGroupOptions o;
  o.size = static_cast<int>(dec.tensor_parallel);
  o.rank = static_cast<int>(dec.node_rank) * ranksPerNode(dec);
  o.local_ranks = ranksPerNode(dec);
  o.child_argv = std::move(argv);
  o.section = "decode";
  o.dist_init_address = dec.dist_init_address;
  o.group_key = hash;
  o.join_timeout = kTpJoinTimeout;
  o.inject_latency = std::chrono::microseconds(dec.tp_inject_latency_us);
  PD_ASSIGN_OR_RETURN(auto group, comm::TpProcessGroup::start(std::move(o)));
  log::info("decode", "tensor-parallel group of {} ranks joined ({})", dec.tensor_parallel, group->describe());
  return group;
}

// Node n > 0 of a multi-node group: its ranks serve the leader; this process also answers the
// orchestrator's probes (/health; /ready while its rank serves) and /metrics on decode.port.
int runNodeFollower(const decode::DecodeConfig& dec, const kvtransfer::KvTransferConfig& kv,
                    const std::vector<std::string>& args, const std::filesystem::path& model_dir, std::uint64_t hash) {
  auto group = startGroup(dec, args, hash);
  if (!group.ok()) return reportFailure(group.error());
  auto serving = std::make_shared<std::atomic<bool>>(false);
  comm::TpProcessGroup* g = group->get();
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
  auto server = http::Server::start(so, std::move(routes));
  if (!server.ok()) return reportFailure(server.error());
  const int rc = serveAsFollower((*group)->comm(), dec, kv, model_dir, hash, [&](bool on) {
    serving->store(on);
    if (on) {
      std::printf("PDSERVE_READY role=decode-rank url=http://%s:%u node_rank=%lld\n", dec.host.c_str(),
                  static_cast<unsigned>((*server)->port()), static_cast<long long>(dec.node_rank));
      std::fflush(stdout);
    }
  });
  (*server)->stop();
  group->reset();
  return rc;
}

// Drains after the first signal; a second one (or the drain timeout) ends the wait.
void drain(decode::DecodeServer& server, const sigset_t& signals, std::chrono::milliseconds timeout) {
  server.beginDrain();
  waitForDrain([&] { return server.waitIdle(std::chrono::milliseconds(50)); }, signals, timeout, "decode",
               [&] { return fmt::format("{} open stream(s)", server.openStreams()); });
}

}  // namespace

int runDecode(const std::vector<std::string>& raw_args) {
  std::vector<std::string> args = raw_args;
  const bool check_only = takeCheckConfigFlag(args);
  CommonConfig common;
  CommonOptions common_sets(common);
  decode::DecodeConfig decode_cfg;
  kvtransfer::KvTransferConfig kv_cfg;
  config::OptionSet decode_set("decode");
  config::OptionSet kv_set("kvtransfer");
  decode::registerOptions(decode_set, decode_cfg);
  kvtransfer::registerOptions(kv_set, kv_cfg);
  auto loaded = loadCommandOptions(std::string(kUsage), {&decode_set, &kv_set, &common_sets.log, &common_sets.model},
                                   args, &common);
  if (!loaded.ok()) return reportFailure(loaded.error());
  if (loaded->help_requested) return 0;
  if (!loaded->positionals.empty()) {
    return reportFailure(
        makeError(ErrorCode::InvalidArgument, fmt::format("unexpected argument '{}'", loaded->positionals.front())));
  }
  if (Status s = validate(decode_cfg, kv_cfg); !s.ok()) return reportFailure(s.error());
  if (check_only) return 0;
  const bool spawned = decode_cfg.tp_rank > 0;
  const bool leader = decode_cfg.tensor_parallel > 1 && !spawned && decode_cfg.node_rank == 0;
  const bool node_follower = !spawned && decode_cfg.node_rank > 0;

  // Signals are taken by sigwait on this thread: block them before any other thread exists. A
  // rank other than the leader never takes them (a terminal's SIGINT reaches the whole process
  // group): the leader stops it, or it dies with its parent.
  const sigset_t signals = blockStopSignals();

  for (const auto* set : {&decode_set, &kv_set}) {
    for (const std::string& v : set->describeValues()) log::info("decode", "{}.{}", set->section(), v);
  }
  auto model_dir = resolveModelDir(common);
  if (!model_dir.ok()) return reportFailure(model_dir.error());
  // The same hash the prefill workers compute (their descriptors and records must match ours).
  auto hash = modelHash(*model_dir);
  if (!hash.ok()) return reportFailure(hash.error());
  if (spawned) return runSpawnedRank(decode_cfg, kv_cfg, *model_dir, *hash);
  if (node_follower) return runNodeFollower(decode_cfg, kv_cfg, args, *model_dir, *hash);

  // Leader: spawn and join the other ranks first (they load their shards meanwhile).
  std::unique_ptr<comm::TpProcessGroup> group;
  if (leader) {
    auto started = startGroup(decode_cfg, args, *hash);
    if (!started.ok()) return reportFailure(started.error());
    group = std::move(started).value();
  }
  auto loaded_engine = loadServingEngine(*model_dir, static_cast<int>(decode_cfg.threads), group.get());
  if (!loaded_engine.ok()) return reportFailure(loaded_engine.error());
  std::unique_ptr<model::Engine> serving = std::move(loaded_engine->engine);
  model::TpLeaderEngine* const tp_leader = loaded_engine->tp_leader;
  log::info("decode", "model {} loaded ({}), hash {}", model_dir->string(), serving->capabilities().backend,
            modelHashHex(*hash));

  decode::DecodeServerOptions options;
  options.decode = decode_cfg;
  options.kvtransfer = kv_cfg;
  options.model_hash = *hash;
  options.tp_leader = tp_leader;
  // The server owns the engine (and so the model::TpLeaderEngine); `group` outlives it (declared first).
  auto server = decode::DecodeServer::start(std::move(serving), options);
  if (!server.ok()) return reportFailure(server.error());
  std::printf("PDSERVE_READY role=decode url=%s\n", (*server)->url().c_str());
  std::fflush(stdout);

  std::function<Status()> watch;
  if (group) {
    watch = [&group]() -> Status {
      PD_TRY(group->checkLocalRanks());
      return group->comm().checkPeers();
    };
  }
  const int sig = waitForSignalWatching(signals, watch, [tp_leader](const Error& e) {
    log::error("decode", "{}: the group is broken; requests fail and /ready answers 503", e.toString());
    tp_leader->markBroken(e);
  });
  log::info("decode", "signal {}: draining", sig);
  drain(**server, signals, std::chrono::milliseconds(decode_cfg.drain_timeout_ms));
  (*server)->stop(std::chrono::milliseconds(0));
  if (tp_leader != nullptr) {
    // Tells the followers to return (they exit 0); ~TpProcessGroup then reaps them.
    if (Status s = tp_leader->stop(); !s.ok()) log::warn("decode", "stopping the followers: {}", s.error().toString());
  }
  (*server).reset();
  group.reset();
  log::info("decode", "stopped");
  return 0;
}

}  // namespace pd::cli
