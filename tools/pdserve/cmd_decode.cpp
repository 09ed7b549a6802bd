// pdserve decode: the decode worker process (issue 6). Loads the model, serves the internal API
// (docs/internal-api.md) through DecodeServer, prints one PDSERVE_READY line on stdout when
// serving, and drains on SIGTERM / SIGINT: /ready turns 503 and new decode streams are refused
// at once (503 Overloaded), open streams may finish for decode.drain_timeout_ms, the rest are
// aborted (each ends with an error line; blocks freed, KV expectations cancelled), and the
// process exits 0. A second signal skips the wait.
// --check-config validates the options and exits (0, or 2 on a bad value) without loading the model.
//
// Tensor parallelism (docs/tensor-parallel.md): with decode.tensor_parallel N > 1 this process is
// rank 0, the leader: it spawns ranks 1..N-1 (its own command line plus --decode.tp_rank r
// --decode.tp_group NAME), serves the API and stops the followers when it stops. A follower
// (tp_rank > 0) prints no READY line, ignores SIGTERM / SIGINT (the leader's drain stops it; it
// dies with the leader) and exits 0 once the leader stopped the group, 1 when the group failed.
// While serving, the leader watches its followers: one that exits breaks the group (requests fail
// with PeerFailed, /ready answers 503).
#include <fmt/format.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cli.h"
#include "pd/common/log.h"
#include "pd/common/model/engine.h"
#include "pd/common/model_hash.h"
#include "pd/common/shm_communicator.h"
#include "pd/decode/decode_config.h"
#include "pd/decode/decode_server.h"
#include "pd/decode/tp_engine.h"
#include "pd/decode/tp_worker.h"
#include "pd/kvtransfer/kvtransfer_config.h"
#include "pd/kvtransfer/ucx_transport.h"

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
  if (dec.tp_rank >= dec.tensor_parallel) {
    return makeError(
        ErrorCode::InvalidArgument,
        fmt::format("decode.tp_rank {} must be below decode.tensor_parallel {}", dec.tp_rank, dec.tensor_parallel));
  }
  if (dec.tp_rank > 0 && dec.tp_group.empty()) {
    return makeError(ErrorCode::InvalidArgument,
                     "decode.tp_rank > 0 (a tensor-parallel follower) needs decode.tp_group; followers are started by "
                     "their leader (decode.tensor_parallel > 1), not by hand");
  }
  return okStatus();
}

constexpr auto kTpJoinTimeout = std::chrono::minutes(10);  // model loading included

// The body of a follower process (tp_rank > 0): joins the leader's group, loads its shard, serves
// the leader's calls until it stops the group.
int runTpFollower(const decode::DecodeConfig& dec, const kvtransfer::KvTransferConfig& kv,
                  const std::filesystem::path& model_dir, std::uint64_t hash) {
  comm::ShmOptions so;
  so.name = dec.tp_group;
  so.rank = static_cast<int>(dec.tp_rank);
  so.size = static_cast<int>(dec.tensor_parallel);
  so.join_timeout = kTpJoinTimeout;
  so.inject_latency = std::chrono::microseconds(dec.tp_inject_latency_us);
  auto comm = comm::createShmCommunicator(so);
  if (!comm.ok()) return reportFailure(comm.error());
  model::CpuEngineOptions engine_options;
  engine_options.threads = static_cast<int>(dec.threads);
  engine_options.tp = comm->get();
  auto engine = model::createCpuEngine(model_dir, engine_options);
  if (!engine.ok()) return reportFailure(engine.error());
  auto worker = decode::TpFollowerWorker::start(std::move(engine).value(), **comm, {dec, kv, hash});
  if (!worker.ok()) return reportFailure(worker.error());
  log::info("decode", "tensor-parallel rank {} of {} serving", dec.tp_rank, dec.tensor_parallel);
  const Status s = (*worker)->run();
  if (!s.ok()) {
    log::error("decode", "tensor-parallel rank {}: {}", dec.tp_rank, s.error().toString());
    return 1;
  }
  log::info("decode", "tensor-parallel rank {} stopped", dec.tp_rank);
  return 0;
}

// Waits for a signal; meanwhile (tensor-parallel leader) watches the followers: one that exits
// breaks the group, so requests fail at once and /ready answers 503 (the process stays up to say
// so; the supervisor decides).
int waitForSignal(const sigset_t& signals, decode::TpLeaderGroup* group, decode::TpLeaderEngine* leader) {
  bool reported = false;
  for (;;) {
    const timespec tick{0, 200'000'000};
    const int sig = ::sigtimedwait(&signals, nullptr, group != nullptr ? &tick : nullptr);
    if (sig > 0) return sig;
    if (group == nullptr || reported) continue;
    const std::vector<std::optional<int>> exits = group->pollFollowers();
    for (std::size_t i = 0; i < exits.size(); ++i) {
      if (!exits[i]) continue;
      const std::string why = fmt::format("tensor-parallel rank {} exited with status {}", i + 1, *exits[i]);
      log::error("decode", "{}: the group is broken; requests fail and /ready answers 503", why);
      leader->markBroken(makeError(ErrorCode::PeerFailed, why));
      reported = true;
      break;
    }
  }
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
  const bool follower = decode_cfg.tp_rank > 0;
  const bool leader = decode_cfg.tensor_parallel > 1 && !follower;

  // Signals are taken by sigwait on this thread: block them before any other thread exists. A
  // follower never takes them (a terminal's SIGINT reaches the whole process group): the leader
  // stops it, or it dies with the leader.
  const sigset_t signals = blockStopSignals();

  for (const auto* set : {&decode_set, &kv_set}) {
    for (const std::string& v : set->describeValues()) log::info("decode", "{}.{}", set->section(), v);
  }
  auto model_dir = resolveModelDir(common);
  if (!model_dir.ok()) return reportFailure(model_dir.error());
  // The same hash the prefill workers compute (their descriptors and records must match ours).
  auto hash = modelHash(*model_dir);
  if (!hash.ok()) return reportFailure(hash.error());
  if (follower) return runTpFollower(decode_cfg, kv_cfg, *model_dir, *hash);

  // Leader: spawn and join the followers first (they load their shards meanwhile).
  std::unique_ptr<decode::TpLeaderGroup> group;
  if (leader) {
    std::error_code ec;
    const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
    if (ec) return reportFailure(makeError(ErrorCode::Io, fmt::format("/proc/self/exe: {}", ec.message())));
    std::vector<std::string> argv{self.string(), "decode"};
    argv.insert(argv.end(), args.begin(), args.end());  // --check-config already removed
    auto started =
        decode::TpLeaderGroup::start(static_cast<int>(decode_cfg.tensor_parallel), std::move(argv), kTpJoinTimeout,
                                     std::chrono::microseconds(decode_cfg.tp_inject_latency_us));
    if (!started.ok()) return reportFailure(started.error());
    group = std::move(started).value();
    log::info("decode", "tensor-parallel group {} of {} ranks joined", group->groupName(), decode_cfg.tensor_parallel);
  }
  model::CpuEngineOptions engine_options;
  engine_options.threads = static_cast<int>(decode_cfg.threads);
  if (group) engine_options.tp = &group->comm();
  auto engine = model::createCpuEngine(*model_dir, engine_options);
  if (!engine.ok()) return reportFailure(engine.error());
  std::unique_ptr<model::Engine> serving = std::move(engine).value();
  decode::TpLeaderEngine* tp_leader = nullptr;
  if (group) {
    auto wrapped = std::make_unique<decode::TpLeaderEngine>(std::move(serving), group->comm());
    tp_leader = wrapped.get();
    serving = std::move(wrapped);
  }
  log::info("decode", "model {} loaded ({}), hash {}", model_dir->string(), serving->capabilities().backend,
            modelHashHex(*hash));

  decode::DecodeServerOptions options;
  options.decode = decode_cfg;
  options.kvtransfer = kv_cfg;
  options.model_hash = *hash;
  options.tp_leader = tp_leader;
  // The server owns the engine (and so the TpLeaderEngine); `group` outlives it (declared first).
  auto server = decode::DecodeServer::start(std::move(serving), options);
  if (!server.ok()) return reportFailure(server.error());
  std::printf("PDSERVE_READY role=decode url=%s\n", (*server)->url().c_str());
  std::fflush(stdout);

  const int sig = waitForSignal(signals, group.get(), tp_leader);
  log::info("decode", "signal {}: draining", sig);
  drain(**server, signals, std::chrono::milliseconds(decode_cfg.drain_timeout_ms));
  (*server)->stop(std::chrono::milliseconds(0));
  if (tp_leader != nullptr) {
    // Tells the followers to return (they exit 0); ~TpLeaderGroup then reaps them.
    if (Status s = tp_leader->stop(); !s.ok()) log::warn("decode", "stopping the followers: {}", s.error().toString());
  }
  (*server).reset();
  group.reset();
  log::info("decode", "stopped");
  return 0;
}

}  // namespace pd::cli
