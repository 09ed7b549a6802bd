// pdserve up: a whole local cluster (router + prefill + decode workers) on one machine, as child
// processes of this one. Each child is this same binary with its role; their log lines come out
// here prefixed with the child's name. Workers start first (any free port each); the router
// starts once every worker printed its PDSERVE_READY line, with their addresses as its static
// worker lists. Ctrl-C / SIGTERM stops the router first (it drains), then the workers; if any
// child dies, the rest are stopped and `up` exits 1.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "cli.h"
#include "pd/common/http_client.h"
#include "pd/common/log.h"
#include "pd/common/subprocess.h"
#include "pd/decode/decode_config.h"
#include "pd/engine/model_config.h"
#include "pd/engine/safetensors.h"
#include "pd/kvtransfer/kvtransfer_config.h"
#include "pd/prefill/prefill_config.h"
#include "pd/router/router_config.h"

namespace pd::cli {

void registerUpOptions(config::OptionSet& set, UpConfig& cfg) {
  set.add("prefill", &cfg.prefill_workers, "prefill worker processes", 1, 64)
      .add("decode", &cfg.decode_workers, "decode worker processes", 1, 64)
      .add("ready_timeout_ms", &cfg.ready_timeout_ms, "how long each process may take to become ready", 1000,
           3600 * 1000)
      .add("stop_timeout_ms", &cfg.stop_timeout_ms,
           "after Ctrl-C, how long each process may take to drain and exit before SIGKILL", 100, 3600 * 1000)
      .add("smoke", &cfg.smoke,
           "start, send one chat completion through the router, print the answer, stop (CI's check)");
}

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr std::string_view kReadyPrefix = "PDSERVE_READY ";

// Ctrl-C and SIGTERM reach the supervisor loop through this pipe.
int g_signal_pipe[2] = {-1, -1};
std::atomic<int> g_signals{0};

void onSignal(int /*signal*/) {
  g_signals.fetch_add(1);
  const char byte = 1;
  [[maybe_unused]] const auto n = ::write(g_signal_pipe[1], &byte, 1);
}

struct Child {
  std::string name;  // "router", "prefill-0", "decode-1"
  std::unique_ptr<proc::Subprocess> process;
  std::unique_ptr<proc::LineReader> out;
  std::unique_ptr<proc::LineReader> err;
  std::string url;  // from PDSERVE_READY
  bool stopping = false;
};

// "PDSERVE_READY role=decode url=http://127.0.0.1:40123" -> the url
std::optional<std::string> readyUrl(std::string_view line) {
  if (!line.starts_with(kReadyPrefix)) return std::nullopt;
  const auto pos = line.find("url=");
  if (pos == std::string_view::npos) return std::nullopt;
  auto url = line.substr(pos + 4);
  url = url.substr(0, url.find(' '));
  return std::string(url);
}

std::string hostPort(const std::string& url) {
  constexpr std::string_view scheme = "http://";
  return url.starts_with(scheme) ? url.substr(scheme.size()) : url;
}

class Supervisor {
 public:
  explicit Supervisor(std::string exe) : exe_(std::move(exe)) {}
  ~Supervisor() { killAll(); }
  Supervisor(const Supervisor&) = delete;
  Supervisor& operator=(const Supervisor&) = delete;
  Supervisor(Supervisor&&) = delete;
  Supervisor& operator=(Supervisor&&) = delete;

  Status start(const std::string& name, std::vector<std::string> args) {
    args.insert(args.begin(), exe_);
    PD_ASSIGN_OR_RETURN(auto process, proc::Subprocess::spawn({std::move(args), {}}));
    Child c;
    c.name = name;
    c.out = std::make_unique<proc::LineReader>(process->stdoutFd());
    c.err = std::make_unique<proc::LineReader>(process->stderrFd());
    c.process = std::move(process);
    children_.push_back(std::move(c));
    return okStatus();
  }

  // Forwards output, notes READY lines and exits, for up to `timeout`. Returns early on a
  // signal. Returns the first child that exited unexpectedly, if any.
  std::optional<std::string> pump(std::chrono::milliseconds timeout) {
    std::vector<pollfd> fds;
    fds.push_back({g_signal_pipe[0], POLLIN, 0});
    for (auto& c : children_) {
      if (!c.out->eof()) fds.push_back({c.process->stdoutFd(), POLLIN, 0});
      if (!c.err->eof()) fds.push_back({c.process->stderrFd(), POLLIN, 0});
    }
    ::poll(fds.data(), fds.size(), static_cast<int>(timeout.count()));
    if ((fds[0].revents & POLLIN) != 0) {
      char buf[16];
      [[maybe_unused]] const auto n = ::read(g_signal_pipe[0], buf, sizeof buf);
    }
    for (auto& c : children_) {
      c.out->drain([&](const std::string& line) {
        if (auto url = readyUrl(line)) {
          c.url = *url;
          log::info("up", "{} ready at {}", c.name, c.url);
          std::fprintf(stdout, "PDSERVE_CHILD name=%s url=%s\n", c.name.c_str(), c.url.c_str());
        } else {
          std::fprintf(stdout, "[%s] %s\n", c.name.c_str(), line.c_str());
        }
      });
      c.err->drain([&](const std::string& line) { std::fprintf(stderr, "[%s] %s\n", c.name.c_str(), line.c_str()); });
    }
    std::fflush(stdout);
    std::fflush(stderr);
    std::optional<std::string> died;
    for (auto& c : children_) {
      if (c.stopping) continue;
      if (auto status = c.process->poll()) {
        c.stopping = true;
        if (!died) died = c.name + " exited with status " + std::to_string(*status);
      }
    }
    return died;
  }

  // Waits until every child named in `names` printed its READY line.
  Status waitReady(const std::vector<std::string>& names, std::chrono::milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    while (true) {
      bool all = true;
      for (const auto& c : children_) {
        for (const auto& n : names) all = all && (c.name != n || !c.url.empty());
      }
      if (all) return okStatus();
      if (g_signals.load() > 0) return makeError(ErrorCode::Cancelled, "interrupted while starting");
      if (auto died = pump(200ms)) return makeError(ErrorCode::PeerFailed, *died + " while starting");
      if (Clock::now() >= deadline) {
        return makeError(ErrorCode::Timeout, "processes not ready within " + std::to_string(timeout.count()) + " ms");
      }
    }
  }

  [[nodiscard]] std::vector<std::string> urls(std::string_view prefix) const {
    std::vector<std::string> out;
    for (const auto& c : children_) {
      if (c.name.starts_with(prefix)) out.push_back(c.url);
    }
    return out;
  }

  // SIGTERM to the children whose name starts with `prefix`, then waits for them to exit,
  // forwarding their output; SIGKILL after `timeout`.
  void stop(std::string_view prefix, std::chrono::milliseconds timeout) {
    for (auto& c : children_) {
      if (c.name.starts_with(prefix)) {
        c.stopping = true;
        c.process->signal(SIGTERM);
      }
    }
    const auto deadline = Clock::now() + timeout;
    while (true) {
      bool running = false;
      for (auto& c : children_) {
        if (c.name.starts_with(prefix) && !c.process->poll()) running = true;
      }
      if (!running) break;
      if (Clock::now() >= deadline) {
        for (auto& c : children_) {
          if (c.name.starts_with(prefix) && !c.process->poll()) {
            log::warn("up", "{} did not stop within {} ms: killing it", c.name, timeout.count());
            c.process->signal(SIGKILL);
          }
        }
        break;
      }
      pump(50ms);
    }
    pump(0ms);
  }

  void killAll() {
    for (auto& c : children_) c.process.reset();
    children_.clear();
  }

 private:
  std::string exe_;
  std::vector<Child> children_;
};

// Sends one chat completion through the router and prints the answer (the --up.smoke check).
Status smokeRequest(const std::string& router_url, const std::string& model_name) {
  const std::string hp = hostPort(router_url);
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

// Polls the router's /ready (forwarding the children's output meanwhile) until it answers 200.
Status waitRouterReady(Supervisor& sup, const std::string& router_url, std::chrono::milliseconds timeout) {
  const std::string hp = hostPort(router_url);
  const auto colon = hp.rfind(':');
  const auto deadline = Clock::now() + timeout;
  http::Client client(hp.substr(0, colon), static_cast<std::uint16_t>(std::stoi(hp.substr(colon + 1))));
  while (true) {
    http::ClientRequest req;
    req.target = "/ready";
    auto r = client.send(req, 2s);
    if (r.ok() && r->status == 200) return okStatus();
    if (!r.ok()) client.disconnect();
    if (g_signals.load() > 0) return makeError(ErrorCode::Cancelled, "interrupted while starting");
    if (auto died = sup.pump(100ms)) return makeError(ErrorCode::PeerFailed, *died + " while starting");
    if (Clock::now() >= deadline) {
      return makeError(ErrorCode::Timeout, "the router did not report ready within " + std::to_string(timeout.count()) +
                                               " ms (are the workers healthy?)");
    }
  }
}

std::string joined(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& i : items) {
    if (!out.empty()) out += ',';
    out += hostPort(i);
  }
  return out;
}

// The short flags of the issue's command line, as the config's long names.
std::vector<std::string> expandAliases(const std::vector<std::string>& args) {
  static const std::vector<std::pair<std::string, std::string>> kAliases = {
      {"--model", "--model.path"},
      {"--prefill", "--up.prefill"},
      {"--decode", "--up.decode"},
      {"--tp", "--decode.tensor_parallel"},
      {"--port", "--router.port"},
      {"--smoke", "--up.smoke"},
      {"--mtp", "--decode.num_speculative_tokens"},
  };
  std::vector<std::string> out;
  for (const auto& a : args) {
    std::string arg = a;
    for (const auto& [alias, name] : kAliases) {
      if (arg == alias) {
        arg = name;
      } else if (arg.starts_with(alias + "=")) {
        arg = name + arg.substr(alias.size());
      }
    }
    out.push_back(std::move(arg));
  }
  return out;
}

// One YAML file holding every resolved setting (defaults < file < env < flags, as `up` saw
// them), so each child reads exactly what `up` validated.
Status writeResolvedConfig(const std::filesystem::path& file, const std::vector<config::OptionSet*>& sets) {
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

}  // namespace

int runUp(const std::vector<std::string>& raw_args) {
  CommonConfig common;
  UpConfig up_cfg;
  router::RouterConfig router_cfg;
  prefill::PrefillConfig prefill_cfg;
  decode::DecodeConfig decode_cfg;
  kvtransfer::KvTransferConfig kv_cfg;
  CommonOptions common_sets(common);
  config::OptionSet up_set("up");
  config::OptionSet router_set("router");
  config::OptionSet prefill_set("prefill");
  config::OptionSet decode_set("decode");
  config::OptionSet kv_set("kvtransfer");
  registerUpOptions(up_set, up_cfg);
  router::registerOptions(router_set, router_cfg);
  prefill::registerOptions(prefill_set, prefill_cfg);
  decode::registerOptions(decode_set, decode_cfg);
  kvtransfer::registerOptions(kv_set, kv_cfg);

  auto loaded = loadCommandOptions(
      "usage: pdserve up [--model DIR] [--prefill N] [--decode M] [--tp T] [--mtp K] [--port P] [--smoke]\n"
      "                  [--config FILE] [options]\n"
      "Starts a router, prefill workers and decode workers on this machine (on --model or the embedded default\n"
      "model), waits until they are ready and serves the OpenAI API on the router's port until Ctrl-C.\n"
      "Short flags: --model = --model.path, --prefill/--decode = --up.prefill/--up.decode,\n"
      "--tp = --decode.tensor_parallel, --mtp = --decode.num_speculative_tokens, --port = --router.port.",
      {&common_sets.log, &common_sets.model, &up_set, &router_set, &prefill_set, &decode_set, &kv_set},
      expandAliases(raw_args), &common);
  if (!loaded.ok()) return reportFailure(loaded.error());
  if (loaded->help_requested) return 0;
  if (!loaded->positionals.empty()) {
    return reportFailure(
        makeError(ErrorCode::InvalidArgument, "up takes no positional arguments: " + loaded->positionals[0]));
  }
  if (up_cfg.prefill_workers > 1 && prefill_cfg.port != 0) {
    return reportFailure(
        makeError(ErrorCode::InvalidArgument, "prefill.port must be 0 (any) with several prefill workers"));
  }
  if (up_cfg.decode_workers > 1 && decode_cfg.port != 0) {
    return reportFailure(
        makeError(ErrorCode::InvalidArgument, "decode.port must be 0 (any) with several decode workers"));
  }

  auto model_dir = resolveModelDir(common);
  if (!model_dir.ok()) return reportFailure(model_dir.error());
  common.model_path = *model_dir;  // the children use the same folder, created once here
  auto model_config = ModelConfig::load(*model_dir);
  if (!model_config.ok()) return reportFailure(model_config.error());
  auto checkpoint = Checkpoint::open(*model_dir);
  if (!checkpoint.ok()) return reportFailure(checkpoint.error());
  if (auto valid = validateCheckpoint(*model_config, *checkpoint); !valid.ok()) return reportFailure(valid.error());
  log::info("up", "model {}: {} layers (+{} MTP), hidden {}, vocab {}", model_dir->string(),
            model_config->num_hidden_layers, model_config->num_nextn_predict_layers, model_config->hidden_size,
            model_config->vocab_size);

  auto exe = proc::selfExecutable();
  if (!exe.ok()) return reportFailure(exe.error());
  const auto run_dir = common.cache_dir / "run" / ("up-" + std::to_string(::getpid()));
  std::error_code ec;
  std::filesystem::create_directories(run_dir, ec);
  if (ec) return reportFailure(makeError(ErrorCode::Io, "cannot create " + run_dir.string() + ": " + ec.message()));
  // The run folder goes on every way out.
  struct RemoveOnExit {
    std::filesystem::path dir;
    ~RemoveOnExit() {
      std::error_code ignored;
      std::filesystem::remove_all(dir, ignored);
    }
  } remove_run_dir{run_dir};
  const auto config_file = run_dir / "config.yaml";
  if (auto s = writeResolvedConfig(
          config_file, {&common_sets.log, &common_sets.model, &router_set, &prefill_set, &decode_set, &kv_set});
      !s.ok()) {
    return reportFailure(s.error());
  }

  if (::pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
    return reportFailure(makeError(ErrorCode::Io, "cannot create the signal pipe"));
  }
  struct sigaction sa = {};
  sa.sa_handler = onSignal;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
  ::signal(SIGPIPE, SIG_IGN);

  const std::chrono::milliseconds ready_timeout{up_cfg.ready_timeout_ms};
  const std::chrono::milliseconds stop_timeout{up_cfg.stop_timeout_ms};
  int exit_code = 0;
  {
    Supervisor sup(*exe);
    const auto fail = [&](const Error& e) {
      log::error("up", "{}", e.toString());
      sup.stop("router", stop_timeout);
      sup.stop("prefill", stop_timeout);
      sup.stop("decode", stop_timeout);
      return 1;
    };
    const std::vector<std::string> base = {"--config", config_file.string()};
    std::vector<std::string> workers;
    for (std::int64_t i = 0; i < up_cfg.decode_workers; ++i) {
      const std::string name = "decode-" + std::to_string(i);
      auto args = base;
      args.insert(args.begin(), "decode");
      if (auto s = sup.start(name, args); !s.ok()) return fail(s.error());
      workers.push_back(name);
    }
    for (std::int64_t i = 0; i < up_cfg.prefill_workers; ++i) {
      const std::string name = "prefill-" + std::to_string(i);
      auto args = base;
      args.insert(args.begin(), "prefill");
      if (auto s = sup.start(name, args); !s.ok()) return fail(s.error());
      workers.push_back(name);
    }
    if (auto s = sup.waitReady(workers, ready_timeout); !s.ok()) return fail(s.error());
    auto router_args = base;
    router_args.insert(router_args.begin(), "router");
    router_args.push_back("--router.prefill_workers=" + joined(sup.urls("prefill")));
    router_args.push_back("--router.decode_workers=" + joined(sup.urls("decode")));
    if (auto s = sup.start("router", router_args); !s.ok()) return fail(s.error());
    if (auto s = sup.waitReady({"router"}, ready_timeout); !s.ok()) return fail(s.error());
    const std::string url = sup.urls("router").front();
    // The router listens before its first health polls have put the workers in rotation; the
    // cluster is ready once the router's /ready says so.
    if (auto s = waitRouterReady(sup, url, ready_timeout); !s.ok()) return fail(s.error());
    std::printf("PDSERVE_READY role=up url=%s\n", url.c_str());
    std::fflush(stdout);

    if (up_cfg.smoke) {
      auto s = smokeRequest(url, router_cfg.served_model_name);
      if (!s.ok()) log::error("up", "smoke: {}", s.error().toString());
      exit_code = s.ok() ? 0 : 1;
    } else {
      std::printf(
          "\npdserve is serving %s on %s (OpenAI API; Ctrl-C stops it)\n\n"
          "  curl %s/v1/chat/completions -H 'Content-Type: application/json' \\\n"
          "    -d '{\"model\": \"%s\", \"messages\": [{\"role\": \"user\", \"content\": \"What is a river?\"}], "
          "\"max_tokens\": 32}'\n\n",
          router_cfg.served_model_name.c_str(), url.c_str(), url.c_str(), router_cfg.served_model_name.c_str());
      std::fflush(stdout);
      while (g_signals.load() == 0) {
        if (auto died = sup.pump(500ms)) {
          log::error("up", "{}: stopping the cluster", *died);
          exit_code = 1;
          break;
        }
      }
      if (exit_code == 0) log::info("up", "stopping: router first, then the workers");
    }
    sup.stop("router", stop_timeout);
    sup.stop("prefill", stop_timeout);
    sup.stop("decode", stop_timeout);
  }
  return exit_code;
}

}  // namespace pd::cli
