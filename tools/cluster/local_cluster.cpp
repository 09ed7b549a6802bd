// pdserve up's local cluster (local_cluster.h): the run folder, the resolved settings file, the
// signal pipe, the supervisor and the smoke request.
#include "cluster/local_cluster.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "cluster/cluster_supervisor.h"
#include "pd/common/http_client.h"
#include "pd/common/internal_auth.h"
#include "pd/common/log.h"
#include "pd/common/role_process.h"
#include "pd/engine/model_config.h"
#include "pd/engine/safetensors.h"

namespace pd::cluster {

void registerUpOptions(config::OptionSet& set, UpConfig& cfg) {
  set.add("prefill", &cfg.prefill_workers, "prefill worker processes", 1, 64)
      .add("decode", &cfg.decode_workers, "decode worker processes", 1, 64)
      .add("ready_timeout_ms", &cfg.ready_timeout_ms, "how long each process may take to become ready", 1000,
           std::int64_t{3600} * 1000)
      .add("stop_timeout_ms", &cfg.stop_timeout_ms,
           "after Ctrl-C, how long each process may take to drain and exit before SIGKILL", 100,
           std::int64_t{3600} * 1000)
      .add("restart_backoff_ms", &cfg.restart_backoff_ms, "delay before restarting a worker that exited (doubles)", 0,
           std::int64_t{3600} * 1000)
      .add("restart_backoff_max_ms", &cfg.restart_backoff_max_ms, "the restart delay doubles up to this", 0,
           std::int64_t{3600} * 1000)
      .add("restart_budget", &cfg.restart_budget,
           "restarts per worker within up.restart_window_ms before the cluster stops (0: never restart)", 0, 1000000)
      .add("restart_window_ms", &cfg.restart_window_ms, "the window of up.restart_budget", 1000, 7LL * 86400 * 1000)
      .add("smoke", &cfg.smoke,
           "start, send one chat completion through the router, print the answer, stop (CI's check)");
}

Status validateUpConfig(const UpConfig& cfg, std::int64_t prefill_port, std::int64_t decode_port) {
  if (cfg.prefill_workers > 1 && prefill_port != 0) {
    return makeError(ErrorCode::InvalidArgument, "prefill.port must be 0 (any) with several prefill workers");
  }
  if (cfg.decode_workers > 1 && decode_port != 0) {
    return makeError(ErrorCode::InvalidArgument, "decode.port must be 0 (any) with several decode workers");
  }
  return okStatus();
}

std::vector<std::string> expandUpAliases(const std::vector<std::string>& args) {
  static const std::vector<std::pair<std::string, std::string>> aliases = {
      {"--model", "--model.path"},
      {"--prefill", "--up.prefill"},
      {"--decode", "--up.decode"},
      {"--tp", "--decode.tensor_parallel"},
      {"--port", "--router.port"},
      {"--smoke", "--up.smoke"},
      {"--mtp", "--decode.num_speculative_tokens"},
      {"--device", "--model.device"},
  };
  std::vector<std::string> out;
  for (const auto& a : args) {
    std::string arg = a;
    for (const auto& [alias, name] : aliases) {
      if (arg == alias) {
        arg = name;
      } else if (arg.starts_with(alias + "=")) {
        arg.replace(0, alias.size(), name);
      }
    }
    out.push_back(std::move(arg));
  }
  return out;
}

Result<GpuMemoryShares> splitGpuMemory(double utilization, std::int64_t prefill_workers, std::int64_t decode_workers) {
  if (!(utilization > 0.0 && utilization <= 1.0)) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("model.gpu_memory_utilization {} is not in (0, 1]", utilization));
  }
  if (prefill_workers < 0 || decode_workers < 0 || prefill_workers + decode_workers == 0) {
    return makeError(ErrorCode::InvalidArgument, "splitting the GPU needs at least one worker");
  }
  const double share = utilization / static_cast<double>(prefill_workers + decode_workers);
  return GpuMemoryShares{share, share};
}

Status writeResolvedConfig(const std::filesystem::path& file, const std::vector<const config::OptionSet*>& sets) {
  std::ofstream out(file);
  if (!out) return makeError(ErrorCode::Io, "cannot write " + file.string());
  for (const auto* set : sets) {
    out << set->section() << ":\n";
    for (const auto& line : set->describeValues()) {
      const auto eq = line.find('=');
      const auto dot = line.find('.');
      std::string value = line.substr(eq + 1);
      std::string quoted = "\"";
      for (char ch : value) {
        if (ch == '"' || ch == '\\') quoted += '\\';
        quoted += ch;
      }
      quoted += '"';
      out << "  " << line.substr(dot + 1, eq - dot - 1) << ": " << quoted << "\n";
    }
  }
  out.close();
  if (!out) return makeError(ErrorCode::Io, "cannot write " + file.string());
  return okStatus();
}

namespace {

using namespace std::chrono_literals;

// Ctrl-C and SIGTERM reach the supervisor loop through this pipe.
int g_signal_pipe[2] = {-1, -1};
std::atomic<int> g_signals{0};

void onSignal(int /*signal*/) {
  g_signals.fetch_add(1);
  const char byte = 1;
  [[maybe_unused]] const auto n = ::write(g_signal_pipe[1], &byte, 1);
}

// Sends one chat completion through the router and prints the answer (the --up.smoke check).
Status smokeRequest(const std::string& router_url, const std::string& model_name) {
  const std::string hp = proc::hostPortOf(router_url);
  const auto colon = hp.rfind(':');
  http::Client client(hp.substr(0, colon), static_cast<std::uint16_t>(std::stoi(hp.substr(colon + 1))));
  http::ClientRequest req;
  req.method = "POST";
  req.target = "/v1/chat/completions";
  req.headers.push_back({"Content-Type", "application/json"});
  req.body = R"({"model":")" + model_name +
             R"(","messages":[{"role":"user","content":"What is a river?"}],"max_tokens":32,"temperature":0})";
  PD_ASSIGN_OR_RETURN(auto response, client.send(req, 120s));
  std::printf("smoke: POST /v1/chat/completions -> HTTP %d\n%s\n", response.status, response.body.c_str());
  std::fflush(stdout);
  if (response.status != 200) {
    return makeError(ErrorCode::PeerFailed, "smoke request answered HTTP " + std::to_string(response.status));
  }
  return okStatus();
}

}  // namespace

Result<int> runLocalCluster(const LocalClusterConfig& cfg) {
  auto model_config = ModelConfig::load(cfg.model_dir);
  if (!model_config.ok()) return model_config.error();
  auto checkpoint = Checkpoint::open(cfg.model_dir);
  if (!checkpoint.ok()) return checkpoint.error();
  if (auto valid = validateCheckpoint(*model_config, *checkpoint); !valid.ok()) return valid.error();
  log::info("up", "model {}: {} layers (+{} MTP), hidden {}, vocab {}", cfg.model_dir.string(),
            model_config->num_hidden_layers, model_config->num_nextn_predict_layers, model_config->hidden_size,
            model_config->vocab_size);

  const auto run_dir = cfg.cache_dir / "run" / ("up-" + std::to_string(::getpid()));
  std::error_code ec;
  std::filesystem::create_directories(run_dir, ec);
  if (ec) return makeError(ErrorCode::Io, "cannot create " + run_dir.string() + ": " + ec.message());
  // The run folder goes on every way out.
  struct RemoveOnExit {
    std::filesystem::path dir;
    explicit RemoveOnExit(std::filesystem::path d) : dir(std::move(d)) {}
    RemoveOnExit(const RemoveOnExit&) = delete;
    RemoveOnExit& operator=(const RemoveOnExit&) = delete;
    ~RemoveOnExit() {
      std::error_code ignored;
      std::filesystem::remove_all(dir, ignored);
    }
  } remove_run_dir{run_dir};
  // Every local cluster signs its internal calls with a fresh secret unless one is given: the
  // flag after --config overrides the file's empty cluster.secret_file in every child.
  std::vector<std::string> child_flags{"--config", (run_dir / "config.yaml").string()};
  if (cfg.cluster_secret_file.empty()) {
    const auto secret_file = run_dir / "cluster-secret";
    if (auto s = writeNewClusterSecret(secret_file); !s.ok()) return s.error();
    child_flags.push_back("--cluster.secret_file=" + secret_file.string());
  }
  if (auto s = writeResolvedConfig(run_dir / "config.yaml", cfg.child_settings); !s.ok()) return s.error();

  if (::pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
    return makeError(ErrorCode::Io, "cannot create the signal pipe");
  }
  struct sigaction sa = {};
  sa.sa_handler = onSignal;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
  ::signal(SIGPIPE, SIG_IGN);

  ClusterOptions options;
  options.executable = cfg.executable;
  options.common_flags = std::move(child_flags);
  options.prefill_workers = cfg.up.prefill_workers;
  options.decode_workers = cfg.up.decode_workers;
  if (cfg.cuda) {
    // One GPU for every worker: each process may use its part of the cluster's utilization.
    PD_ASSIGN_OR_RETURN(const GpuMemoryShares shares,
                        splitGpuMemory(cfg.gpu_memory_utilization, cfg.up.prefill_workers, cfg.up.decode_workers));
    options.prefill_flags.push_back(fmt::format("--model.gpu_memory_utilization={}", shares.prefill));
    options.decode_flags.push_back(fmt::format("--model.gpu_memory_utilization={}", shares.decode));
    log::info("up", "one GPU for {} worker(s): gpu_memory_utilization {} each (prefill), {} each (decode)",
              cfg.up.prefill_workers + cfg.up.decode_workers, shares.prefill, shares.decode);
  }
  options.ready_timeout = std::chrono::milliseconds{cfg.up.ready_timeout_ms};
  options.stop_timeout = std::chrono::milliseconds{cfg.up.stop_timeout_ms};
  options.restart.backoff_initial = std::chrono::milliseconds{cfg.up.restart_backoff_ms};
  options.restart.backoff_max = std::chrono::milliseconds{cfg.up.restart_backoff_max_ms};
  options.restart.budget = cfg.up.restart_budget;
  options.restart.window = std::chrono::milliseconds{cfg.up.restart_window_ms};
  ClusterSupervisor cluster(std::move(options), g_signals, g_signal_pipe[0]);
  int exit_code = 0;
  if (auto url = cluster.start(); !url.ok()) {
    log::error("up", "{}", url.error().toString());
    exit_code = 1;
  } else {
    std::printf("PDSERVE_READY role=up url=%s\n", url->c_str());
    std::fflush(stdout);
    if (cfg.up.smoke) {
      auto s = smokeRequest(*url, cfg.served_model_name);
      if (!s.ok()) log::error("up", "smoke: {}", s.error().toString());
      exit_code = s.ok() ? 0 : 1;
    } else {
      std::printf(
          "\npdserve is serving %s on %s (OpenAI API; Ctrl-C stops it)\n\n"
          "  curl %s/v1/chat/completions -H 'Content-Type: application/json' \\\n"
          "    -d '{\"model\": \"%s\", \"messages\": [{\"role\": \"user\", \"content\": \"What is a river?\"}], "
          "\"max_tokens\": 32}'\n\n",
          cfg.served_model_name.c_str(), url->c_str(), url->c_str(), cfg.served_model_name.c_str());
      std::fflush(stdout);
      if (Status s = cluster.superviseUntilStopped(); !s.ok()) {
        log::error("up", "{}: stopping the cluster", s.error().toString());
        exit_code = 1;
      } else {
        log::info("up", "stopping: router first, then the workers");
      }
    }
  }
  cluster.stopAll();
  return exit_code;
}

}  // namespace pd::cluster
