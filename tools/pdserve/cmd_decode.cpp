// pdserve decode: the decode worker process (issue 6). Loads the model, serves the internal API
// (docs/internal-api.md) through DecodeServer, prints one PDSERVE_READY line on stdout when
// serving, and drains on SIGTERM / SIGINT: /ready turns 503 and new decode streams are refused
// at once (503 Overloaded), open streams may finish for decode.drain_timeout_ms, the rest are
// aborted (each ends with an error line; blocks freed, KV expectations cancelled), and the
// process exits 0. A second signal skips the wait.
// --check-config validates the options and exits (0, or 2 on a bad value) without loading the model.
#include <fmt/format.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <ctime>
#include <string_view>

#include "cli.h"
#include "pd/common/log.h"
#include "pd/common/model_hash.h"
#include "pd/common/model/engine.h"
#include "pd/decode/decode_config.h"
#include "pd/decode/decode_server.h"
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
  PD_TRY(kvtransfer::parseKvDataPath(kv.data_path));
  if (kv.ucx_tls.find("tcp") == std::string::npos) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("kvtransfer.ucx_tls '{}' must include tcp (peer failure detection)", kv.ucx_tls));
  }
  if (dec.tensor_parallel != 1) {
    return makeError(
        ErrorCode::InvalidArgument,
        fmt::format("decode.tensor_parallel {}: this build serves tensor_parallel 1 only", dec.tensor_parallel));
  }
  return okStatus();
}

// Drains after the first signal; a second one (or the drain timeout) ends the wait.
void drain(decode::DecodeServer& server, const sigset_t& signals, std::chrono::milliseconds timeout) {
  server.beginDrain();
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!server.waitIdle(std::chrono::milliseconds(50))) {
    if (std::chrono::steady_clock::now() >= deadline) {
      log::warn("decode", "drain timeout ({} ms) passed: aborting {} open stream(s)", timeout.count(),
                server.openStreams());
      return;
    }
    const timespec zero{0, 0};
    if (::sigtimedwait(&signals, nullptr, &zero) > 0) {
      log::warn("decode", "second signal: aborting {} open stream(s)", server.openStreams());
      return;
    }
  }
}

}  // namespace

int runDecode(const std::vector<std::string>& raw_args) {
  std::vector<std::string> args;
  bool check_only = false;
  for (const std::string& a : raw_args) {
    if (a == "--check-config" || a == "--check_config") {
      check_only = true;
    } else {
      args.push_back(a);
    }
  }
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

  // Signals are taken by sigwait on this thread: block them before any other thread exists.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  for (const auto* set : {&decode_set, &kv_set}) {
    for (const std::string& v : set->describeValues()) log::info("decode", "{}.{}", set->section(), v);
  }
  auto model_dir = resolveModelDir(common);
  if (!model_dir.ok()) return reportFailure(model_dir.error());
  // The same hash the prefill workers compute (their descriptors and records must match ours).
  auto hash = modelHash(*model_dir);
  if (!hash.ok()) return reportFailure(hash.error());
  model::CpuEngineOptions engine_options;
  engine_options.threads = static_cast<int>(decode_cfg.threads);
  auto engine = model::createCpuEngine(*model_dir, engine_options);
  if (!engine.ok()) return reportFailure(engine.error());
  log::info("decode", "model {} loaded ({}), hash {}", model_dir->string(), (*engine)->capabilities().backend,
            modelHashHex(*hash));

  decode::DecodeServerOptions options;
  options.decode = decode_cfg;
  options.kvtransfer = kv_cfg;
  options.model_hash = *hash;
  auto server = decode::DecodeServer::start(std::move(engine).value(), options);
  if (!server.ok()) return reportFailure(server.error());
  std::printf("PDSERVE_READY role=decode url=%s\n", (*server)->url().c_str());
  std::fflush(stdout);

  int sig = 0;
  if (sigwait(&signals, &sig) == 0) log::info("decode", "signal {}: draining", sig);
  drain(**server, signals, std::chrono::milliseconds(decode_cfg.drain_timeout_ms));
  (*server)->stop(std::chrono::milliseconds(0));
  log::info("decode", "stopped");
  return 0;
}

}  // namespace pd::cli
