// The run of `pdserve bench router` (router_bench.h): three child roles, the two ways of sending,
// the held streams' thread count.
#include "bench/router/router_bench.h"

#include <fmt/format.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <boost/json.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "bench/router/router_overhead.h"
#include "pd/common/http_client.h"
#include "pd/common/http_server.h"
#include "pd/common/log.h"
#include "pd/common/role_process.h"
#include "pd/common/worker_api.h"

namespace pd::bench {

Result<std::vector<std::int64_t>> parseConcurrencyLevels(const std::string& text) {
  std::vector<std::int64_t> out;
  try {
    std::size_t pos = 0;
    while (pos < text.size()) {
      auto comma = text.find(',', pos);
      if (comma == std::string::npos) comma = text.size();
      out.push_back(std::stoll(text.substr(pos, comma - pos)));
      pos = comma + 1;
    }
  } catch (const std::exception&) {
    return makeError(ErrorCode::InvalidArgument, "bench_router.concurrency: not a list of integers");
  }
  for (const auto c : out) {
    if (c < 1 || c > 1024) return makeError(ErrorCode::InvalidArgument, "concurrency must be 1..1024");
  }
  return out;
}

std::int64_t gaugeValue(std::string_view metrics_text, std::string_view name) {
  const std::string key = "\n" + std::string(name) + " ";
  const std::string text = "\n" + std::string(metrics_text);
  const auto pos = text.find(key);
  if (pos == std::string::npos) return -1;
  double value = -1;
  try {
    value = std::stod(text.substr(pos + key.size()));
  } catch (const std::exception&) {
    return -1;
  }
  // A hostile or broken page may say nan or 1e300: no cast of those to an integer.
  return std::isfinite(value) && value >= 0 && value < 1e15 ? static_cast<std::int64_t>(value) : -1;
}

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

struct Endpoint {
  std::string host;
  std::uint16_t port = 0;
};

Endpoint parseHostPort(const std::string& url) {
  std::string hp = url.starts_with("http://") ? url.substr(7) : url;
  const auto colon = hp.rfind(':');
  return {hp.substr(0, colon), static_cast<std::uint16_t>(std::stoi(hp.substr(colon + 1)))};
}

// A child role process (this binary) and the address of its PDSERVE_READY line.
struct Role {
  std::unique_ptr<proc::RoleProcess> process;
  Endpoint endpoint;
};

Result<Role> startRole(const std::string& exe, std::vector<std::string> args) {
  args.insert(args.begin(), exe);
  PD_ASSIGN_OR_RETURN(auto process, proc::RoleProcess::spawn({std::move(args), {}, false, {}}));
  PD_TRY(process->waitReady(300s));
  Endpoint endpoint = parseHostPort(process->url());
  return Role{std::move(process), std::move(endpoint)};
}

// One request through the router; its latency in µs, or an error.
Result<double> viaRouter(http::Client& client, const std::string& body) {
  http::ClientRequest req;
  req.method = "POST";
  req.target = "/v1/completions";
  req.headers = {{"Content-Type", "application/json"}};
  req.body = body;
  const auto start = Clock::now();
  PD_ASSIGN_OR_RETURN(auto response, client.send(req, 60s));
  const double us = std::chrono::duration<double, std::micro>(Clock::now() - start).count();
  if (response.status != 200) {
    return makeError(ErrorCode::PeerFailed, "router answered HTTP " + std::to_string(response.status));
  }
  return us;
}

// The same request with the bench as the router: decode stream + prefill submission.
Result<double> direct(http::Client& decode, http::Client& prefill, const std::vector<std::int32_t>& prompt,
                      std::uint64_t serial) {
  worker_api::DecodeOpen open;
  open.request_id = "bench-" + std::to_string(serial);
  open.prompt_tokens = static_cast<std::int64_t>(prompt.size());
  open.max_tokens = 1;
  open.sampling.seed = serial;
  open.kv_timeout_ms = 60000;
  http::ClientRequest req;
  req.method = "POST";
  req.target = std::string(worker_api::kDecodeOpenPath);
  req.headers = {{"Content-Type", "application/json"}};
  req.body = worker_api::toJson(open);
  std::optional<Error> failure;
  bool finished = false;
  const auto start = Clock::now();
  auto response = decode.streamLines(req, 60s, [&](std::string_view line) {
    auto event = worker_api::parseDecodeEvent(line);
    if (!event.ok()) {
      failure = event.error();
      return false;
    }
    if (event->type == worker_api::DecodeEventType::Descriptor) {
      worker_api::PrefillSubmit submit;
      submit.request_id = open.request_id;
      submit.token_ids = prompt;
      submit.sampling = open.sampling;
      submit.kv_descriptor = event->kv_descriptor;
      http::ClientRequest preq;
      preq.method = "POST";
      preq.target = std::string(worker_api::kPrefillPath);
      preq.headers = {{"Content-Type", "application/json"}};
      preq.body = worker_api::toJson(submit);
      auto answer = prefill.send(preq, 60s);
      if (!answer.ok() || answer->status != 200) {
        failure = answer.ok() ? worker_api::parseErrorJson(answer->status, answer->body) : answer.error();
        return false;
      }
    } else if (event->type == worker_api::DecodeEventType::Finish) {
      finished = true;
    } else if (event->type == worker_api::DecodeEventType::Error) {
      failure = makeError(event->code, event->message);
      return false;
    }
    return true;
  });
  const double us = std::chrono::duration<double, std::micro>(Clock::now() - start).count();
  if (!response.ok()) return response.error();
  if (failure) return *failure;
  if (response->status != 200) return worker_api::parseErrorJson(response->status, response->body);
  if (!finished) return makeError(ErrorCode::PeerFailed, "decode stream ended without a finish event");
  return us;
}

/// The Threads line of /proc/<pid>/status; 0 when unreadable.
std::int64_t threadCount(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("Threads:", 0) == 0) return std::stoll(line.substr(8));
  }
  return 0;
}

/// A plain TCP connection to 127.0.0.1:port with `request` sent on it; -1 on failure.
int openAndSend(std::uint16_t port, const std::string& request) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::send(fd, request.data(), request.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(request.size())) {
    ::close(fd);
    return -1;
  }
  return fd;
}

/// Polls GET /ready of a router until 200 (at most 10 s).
void waitReady(const Endpoint& router) {
  for (int i = 0; i < 100; ++i) {
    http::Client probe(router.host, router.port);
    http::ClientRequest req;
    req.target = "/ready";
    auto r = probe.send(req, 5s);
    if (r.ok() && r->status == 200) return;
    std::this_thread::sleep_for(100ms);
  }
}

/// A temp folder for the traced router's span file; removed with everything in it.
class TraceFolder {
 public:
  static Result<TraceFolder> create() {
    std::string pattern = (std::filesystem::temp_directory_path() / "pdserve-bench-trace-XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) return makeError(ErrorCode::Io, "cannot create a temp folder");
    return TraceFolder(pattern);
  }
  TraceFolder(TraceFolder&& o) noexcept : dir_(std::exchange(o.dir_, {})) {}
  TraceFolder& operator=(TraceFolder&&) = delete;
  TraceFolder(const TraceFolder&) = delete;
  TraceFolder& operator=(const TraceFolder&) = delete;
  ~TraceFolder() {
    std::error_code ec;
    if (!dir_.empty()) std::filesystem::remove_all(dir_, ec);
  }
  [[nodiscard]] std::string file() const { return (dir_ / "spans.jsonl").string(); }
  /// How many times `needle` occurs in the span file (the spans the traced router exported).
  [[nodiscard]] std::int64_t count(std::string_view needle) const {
    std::ifstream in(file());
    std::int64_t n = 0;
    for (std::string line; std::getline(in, line);) {
      for (auto pos = line.find(needle); pos != std::string::npos; pos = line.find(needle, pos + 1)) ++n;
    }
    return n;
  }

 private:
  explicit TraceFolder(std::filesystem::path dir) : dir_(std::move(dir)) {}
  std::filesystem::path dir_;
};

struct HeldStreams {
  std::int64_t opened = 0;
  std::int64_t threads_before = 0;
  std::int64_t threads_max = 0;
  std::int64_t in_flight_max = 0;
};

/// The router's pdserve_router_requests_in_flight gauge; -1 when unreadable.
std::int64_t inFlight(const Endpoint& router) {
  http::Client client(router.host, router.port);
  auto r = client.send({"GET", "/metrics", {}, {}}, 5s);
  if (!r.ok() || r->status != 200) return -1;
  return gaugeValue(r->body, "pdserve_router_requests_in_flight");
}

/// Opens `n` streaming completions through the router at once and samples its thread count
/// until they are all in flight (or 30 s pass), then hangs them all up.
HeldStreams holdStreams(const Endpoint& router, pid_t pid, std::int64_t n, const std::string& body) {
  HeldStreams out;
  out.threads_before = threadCount(pid);
  const std::string request =
      "POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
      "Content-Length: " +
      std::to_string(body.size()) + "\r\n\r\n" + body;
  std::vector<int> fds;
  for (std::int64_t i = 0; i < n; ++i) {
    const int fd = openAndSend(router.port, request);
    if (fd >= 0) fds.push_back(fd);
  }
  out.opened = static_cast<std::int64_t>(fds.size());
  const auto until = Clock::now() + 30s;
  while (Clock::now() < until) {
    out.threads_max = std::max(out.threads_max, threadCount(pid));
    const std::int64_t in_flight = inFlight(router);
    out.in_flight_max = std::max(out.in_flight_max, in_flight);
    if (in_flight >= out.opened) break;
    std::this_thread::sleep_for(20ms);
  }
  out.threads_max = std::max(out.threads_max, threadCount(pid));
  for (const int fd : fds) ::close(fd);
  return out;
}

}  // namespace

Result<void> runRouterBench(const RouterBenchConfig& cfg) {
  const std::string exe = cfg.executable.string();
  const std::string model_flag = "--model.path=" + cfg.model.string();
  std::vector<std::string> extra;
  if (!cfg.tokenizer.empty()) extra.push_back("--model.tokenizer=" + cfg.tokenizer.string());
  auto with_extra = [&](std::vector<std::string> a) {
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  http::raiseFdLimit();  // --hold_streams holds one socket per stream
  std::vector<std::string> decode_args{"decode", model_flag, "--decode.port=0", "--log.level=warn"};
  // Held streams each reserve their KV blocks at once; the rest of them wait for a batch slot.
  if (cfg.hold_streams > 0) decode_args.push_back("--decode.num_blocks=" + std::to_string(cfg.hold_streams * 8 + 64));
  auto decode = startRole(exe, with_extra(decode_args));
  if (!decode.ok()) return decode.error();
  std::vector<std::string> prefill_args{"prefill", model_flag, "--prefill.port=0", "--log.level=warn"};
  if (cfg.hold_streams > 0) {
    prefill_args.push_back("--prefill.max_queued_requests=" + std::to_string(cfg.hold_streams + 64));
  }
  auto prefill = startRole(exe, with_extra(prefill_args));
  if (!prefill.ok()) return prefill.error();
  const auto hp = [](const Endpoint& e) { return e.host + ":" + std::to_string(e.port); };
  const std::vector<std::string> router_args{"router",
                                             model_flag,
                                             "--router.port=0",
                                             "--log.level=warn",
                                             "--router.io_threads=" + std::to_string(cfg.io_threads),
                                             "--router.max_queued_requests=" + std::to_string(cfg.hold_streams + 1024),
                                             "--router.prefill_workers=" + hp(prefill->endpoint),
                                             "--router.decode_workers=" + hp(decode->endpoint)};
  auto router = startRole(exe, with_extra(router_args));
  if (!router.ok()) return router.error();
  // The traced router: the same, recording every request's spans into a file.
  std::optional<TraceFolder> trace_folder;
  std::optional<Role> traced;
  if (cfg.tracing) {
    auto folder = TraceFolder::create();
    if (!folder.ok()) return folder.error();
    trace_folder.emplace(std::move(*folder));
    std::vector<std::string> args = router_args;
    args.insert(args.end(), {"--trace.file=" + trace_folder->file(), "--trace.sample_ratio=1"});
    auto role = startRole(exe, with_extra(args));
    if (!role.ok()) return role.error();
    traced.emplace(std::move(*role));
  }
  // A router marks workers ready after its first health poll.
  for (const Role* r : {&*router, traced ? &*traced : nullptr}) {
    if (r != nullptr) waitReady(r->endpoint);
  }

  std::vector<std::int32_t> prompt;
  boost::json::array prompt_json;
  for (std::int64_t i = 0; i < cfg.prompt_tokens; ++i) {
    prompt.push_back(static_cast<std::int32_t>(100 + i));
    prompt_json.push_back(100 + i);
  }
  const std::string body = boost::json::serialize(boost::json::object{
      {"model", "pdserve-default"}, {"prompt", prompt_json}, {"max_tokens", 1}, {"temperature", 0}});

  boost::json::object report;
  report["requests_per_level"] = cfg.requests;
  report["prompt_tokens"] = cfg.prompt_tokens;
  std::atomic<std::uint64_t> serial{1};
  int failures = 0;
  for (auto level : cfg.concurrency) {
    std::mutex mutex;
    std::vector<double> via;
    std::vector<double> via_traced;
    std::vector<double> straight;
    std::optional<Error> first_error;
    const auto worker = [&](std::int64_t count, bool record) {
      http::Client rc(router->endpoint.host, router->endpoint.port);
      http::Client dc(decode->endpoint.host, decode->endpoint.port);
      http::Client pc(prefill->endpoint.host, prefill->endpoint.port);
      std::optional<http::Client> tc;
      if (traced) tc.emplace(traced->endpoint.host, traced->endpoint.port);
      for (std::int64_t i = 0; i < count; ++i) {
        auto a = viaRouter(rc, body);
        Result<double> t = tc ? viaRouter(*tc, body) : Result<double>(0.0);
        auto b = direct(dc, pc, prompt, serial.fetch_add(1));
        std::lock_guard lock(mutex);
        if (!a.ok() || !b.ok() || !t.ok()) {
          if (!first_error) first_error = !a.ok() ? a.error() : !t.ok() ? t.error() : b.error();
          continue;
        }
        if (record) {
          via.push_back(*a);
          if (tc) via_traced.push_back(*t);
          straight.push_back(*b);
        }
      }
    };
    const auto run = [&](std::int64_t total, bool record) {
      std::vector<std::thread> threads;
      for (std::int64_t t = 0; t < level; ++t) {
        const std::int64_t share = total / level + (t < total % level ? 1 : 0);
        threads.emplace_back(worker, share, record);
      }
      for (auto& t : threads) t.join();
    };
    run(std::max<std::int64_t>(cfg.warmup, level), false);
    run(cfg.requests, true);
    if (first_error) {
      ++failures;
      log::error("bench", "concurrency {}: {}", level, first_error->toString());
    }
    const bench::RouterOverhead o = bench::routerOverhead(via, straight);
    const double rp50 = o.router_p50_us;
    const double rp99 = o.router_p99_us;
    const double dp50 = o.direct_p50_us;
    const double dp99 = o.direct_p99_us;
    boost::json::object row{{"concurrency", level},           {"samples", via.size()},         {"router_p50_us", rp50},
                            {"router_p99_us", rp99},          {"direct_p50_us", dp50},         {"direct_p99_us", dp99},
                            {"overhead_p50_us", rp50 - dp50}, {"overhead_p99_us", rp99 - dp99}};
    if (!cfg.json) {
      std::printf(
          "concurrency %3lld: through router p50 %8.0f us p99 %8.0f us | direct p50 %8.0f us p99 %8.0f us | "
          "overhead p50 %6.0f us p99 %6.0f us (%zu samples)\n",
          static_cast<long long>(level), rp50, rp99, dp50, dp99, rp50 - dp50, rp99 - dp99, via.size());
      std::fflush(stdout);
    }
    if (traced) {
      // Tracing's cost: the traced router against the untraced one, timed in the same rounds.
      const bench::RouterOverhead t = bench::routerOverhead(via_traced, straight);
      const auto ratio = [](double a, double b) { return b > 0 ? a / b : 0.0; };
      row["traced_p50_us"] = t.router_p50_us;
      row["traced_p99_us"] = t.router_p99_us;
      row["traced_overhead_p50_us"] = t.overhead_p50_us;
      row["traced_overhead_p99_us"] = t.overhead_p99_us;
      row["tracing_latency_ratio_p50"] = ratio(t.router_p50_us, rp50);
      row["tracing_latency_ratio_p99"] = ratio(t.router_p99_us, rp99);
      if (!cfg.json) {
        std::printf(
            "                 tracing 1.0: through router p50 %8.0f us p99 %8.0f us | overhead p50 %6.0f us p99 %6.0f "
            "us | latency traced/untraced p50 %.3f p99 %.3f\n",
            t.router_p50_us, t.router_p99_us, t.overhead_p50_us, t.overhead_p99_us, ratio(t.router_p50_us, rp50),
            ratio(t.router_p99_us, rp99));
        std::fflush(stdout);
      }
    }
    report["concurrency_" + std::to_string(level)] = std::move(row);
  }
  if (cfg.hold_streams > 0) {
    const std::string stream_body = boost::json::serialize(boost::json::object{{"model", "pdserve-default"},
                                                                               {"prompt", prompt_json},
                                                                               {"max_tokens", 64},
                                                                               {"ignore_eos", true},
                                                                               {"stream", true}});
    const HeldStreams held = holdStreams(router->endpoint, router->process->pid(), cfg.hold_streams, stream_body);
    if (!cfg.json) {
      std::printf(
          "held streams: %lld opened, %lld in flight at most | router threads %lld before, %lld at most while "
          "held | configured I/O threads %lld\n",
          static_cast<long long>(held.opened), static_cast<long long>(held.in_flight_max),
          static_cast<long long>(held.threads_before), static_cast<long long>(held.threads_max),
          static_cast<long long>(cfg.io_threads));
      std::fflush(stdout);
    }
    report["held_streams"] = boost::json::object{{"opened", held.opened},
                                                 {"in_flight_max", held.in_flight_max},
                                                 {"router_threads_before", held.threads_before},
                                                 {"router_threads_max", held.threads_max},
                                                 {"router_io_threads", cfg.io_threads}};
  }
  for (auto* role : {&*router, &*prefill, &*decode}) role->process->stop(30s);
  if (traced) {
    traced->process->stop(30s);  // its exporter writes what is queued on the way out
    const std::int64_t spans = trace_folder->count("\"name\":\"router.request\"");
    report["traced_requests_in_file"] = spans;
    if (!cfg.json)
      std::printf("traced router: %lld router.request spans in its trace file\n", static_cast<long long>(spans));
  }
  if (cfg.json) std::printf("%s\n", boost::json::serialize(report).c_str());
  if (failures > 0) {
    return makeError(ErrorCode::PeerFailed, fmt::format("{} concurrency level(s) had failed requests", failures));
  }
  return okStatus();
}

}  // namespace pd::bench
