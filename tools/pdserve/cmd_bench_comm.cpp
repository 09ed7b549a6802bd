// `pdserve bench comm`: latency of the host tensor-parallel communicator's allreduce of one
// hidden vector between two processes (the decode step's per-layer collective at batch 1),
// compared with ucx_perftest's one-way message latency (ucp_am_lat) for the same bytes over
// UCX shared memory and TCP, measured in the same run. ratio = ours / ucx_perftest (lower is
// better; ~1 means the collective costs one one-way message).
#include <fmt/format.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <boost/json.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "bench/common/bench_util.h"
#include "cli.h"
#include "pd/comm/shm_communicator.h"

extern char** environ;

namespace pd::cli {

using namespace bench;  // NOLINT(google-build-using-namespace): the shared bench helpers
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr const char* kUsage =
    "usage: pdserve bench comm [--floats 7168,256] [--iterations 5000] [--spin-us 1000] [--json]\n"
    "                         [--perftest ucx_perftest]\n"
    "Measures the shared-memory communicator's allreduce of N floats between two processes (median\n"
    "per call) and ucx_perftest ucp_am_lat (one-way latency, median) for 4N bytes over UCX_TLS=sm\n"
    "and UCX_TLS=tcp; prints both and ours / perftest. 7168 = DeepSeek-V3's hidden size.";

struct Config {
  std::vector<std::int64_t> floats{7168, 256};
  std::int64_t iterations = 5000;
  bool json = false;
  std::string perftest = "ucx_perftest";
  std::int64_t spin_us = 1000;  ///< ShmOptions::spin
};

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct OursResult {
  double median_us = 0;
  double mean_us = 0;
  double p99_us = 0;
};

// Rank 1 runs in a forked child (forked before any thread exists); rank 0 times each call.
Result<OursResult> measureOurs(std::int64_t floats, std::int64_t iterations, std::int64_t spin_us) {
  comm::ShmOptions o;
  o.spin = std::chrono::microseconds(spin_us);
  o.name = comm::uniqueShmName();
  o.size = 2;
  o.timeout = 30s;
  const std::int64_t warmup = std::max<std::int64_t>(100, iterations / 10);
  const pid_t child = fork();
  if (child < 0) return makeError(ErrorCode::Io, "fork failed");
  if (child == 0) {
    o.rank = 1;
    auto c = comm::createShmCommunicator(o);
    if (!c.ok()) _exit(10);
    std::vector<float> v(static_cast<std::size_t>(floats), 1.0F);
    for (std::int64_t i = 0; i < warmup + iterations; ++i) {
      if (!(*c)->allReduceSum(v).ok()) _exit(11);
    }
    _exit(0);
  }
  auto c = comm::createShmCommunicator(o);
  if (!c.ok()) {
    ::waitpid(child, nullptr, 0);
    return std::move(c).error();
  }
  std::vector<float> v(static_cast<std::size_t>(floats), 1.0F);
  std::vector<double> us;
  us.reserve(static_cast<std::size_t>(iterations));
  double total = 0;
  for (std::int64_t i = 0; i < warmup + iterations; ++i) {
    const auto t0 = Clock::now();
    if (Status s = (*c)->allReduceSum(v); !s.ok()) {
      ::waitpid(child, nullptr, 0);
      return std::move(s).error();
    }
    const double d = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
    if (i >= warmup) {
      us.push_back(d);
      total += d;
    }
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return makeError(ErrorCode::PeerFailed, "rank 1 failed");
  OursResult r;
  r.median_us = median(us);
  r.mean_us = total / static_cast<double>(us.size());
  std::sort(us.begin(), us.end());
  r.p99_us = us[us.size() * 99 / 100];
  return r;
}

// ucx_perftest ucp_am_lat between two local processes: the median one-way latency in us.
Result<double> perftestLatency(const std::string& perftest, const std::string& tls, std::int64_t bytes,
                               std::int64_t iterations) {
  for (int attempt = 0; attempt < 5; ++attempt) {
    const std::string port = std::to_string(20000 + (::getpid() * 7 + attempt * 131) % 30000);
    FILE* server_out = std::tmpfile();
    FILE* client_out = std::tmpfile();
    if (server_out == nullptr || client_out == nullptr) return makeError(ErrorCode::Io, "tmpfile");
    const auto server = spawnWithUcxEnv({perftest, "-p", port}, {{"TLS", tls}}, fileno(server_out));
    if (!server) {
      std::fclose(server_out);
      std::fclose(client_out);
      return makeError(ErrorCode::NotFound, fmt::format("cannot run '{}' (ucx-utils)", perftest));
    }
    std::this_thread::sleep_for(200ms);
    const auto client = spawnWithUcxEnv({perftest, "127.0.0.1", "-p", port, "-t", "ucp_am_lat", "-s",
                                         std::to_string(bytes), "-n", std::to_string(iterations), "-w", "500", "-v"},
                                        {{"TLS", tls}}, fileno(client_out));
    const bool ok = client && reapWithin(*client, 120s);
    (void)reapWithin(*server, ok ? 10s : 1s);
    std::string text;
    std::rewind(client_out);
    char buf[4096];
    for (std::size_t n; (n = std::fread(buf, 1, sizeof(buf), client_out)) > 0;) text.append(buf, n);
    std::fclose(server_out);
    std::fclose(client_out);
    if (!ok) continue;
    // CSV: iterations,50.0_percentile_lat,avg_lat,overall_lat,... (us)
    const auto last = text.find_last_not_of("\n ");
    const auto start = text.rfind('\n', last == std::string::npos ? 0 : last);
    const std::string line = text.substr(start == std::string::npos ? 0 : start + 1);
    const auto c1 = line.find(',');
    if (c1 != std::string::npos) {
      const double lat = std::strtod(line.c_str() + c1 + 1, nullptr);
      if (lat > 0) return lat;
    }
    return makeError(ErrorCode::Internal, "could not parse ucx_perftest output: " + text);
  }
  return makeError(ErrorCode::Internal, "ucx_perftest failed 5 times");
}

Result<Config> parse(const std::vector<std::string>& args) {
  Config c;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    const auto value = [&]() -> Result<std::string> {
      if (i + 1 >= args.size()) return makeError(ErrorCode::InvalidArgument, a + " needs a value");
      return args[++i];
    };
    if (a == "--json") {
      c.json = true;
    } else if (a == "--floats") {
      PD_ASSIGN_OR_RETURN(std::string v, value());
      c.floats.clear();
      for (std::size_t p = 0; p <= v.size();) {
        const std::size_t q = std::min(v.find(',', p), v.size());
        const long long n = std::atoll(v.substr(p, q - p).c_str());
        if (n <= 0 || n > (1LL << 26)) return makeError(ErrorCode::InvalidArgument, "--floats: bad count in " + v);
        c.floats.push_back(n);
        p = q + 1;
      }
    } else if (a == "--iterations") {
      PD_ASSIGN_OR_RETURN(std::string v, value());
      c.iterations = std::atoll(v.c_str());
      if (c.iterations < 10) return makeError(ErrorCode::InvalidArgument, "--iterations must be >= 10");
    } else if (a == "--spin-us") {
      PD_ASSIGN_OR_RETURN(std::string v, value());
      c.spin_us = std::atoll(v.c_str());
      if (c.spin_us < 0 || c.spin_us > 10'000'000) return makeError(ErrorCode::InvalidArgument, "--spin-us: 0..1e7");
    } else if (a == "--perftest") {
      PD_ASSIGN_OR_RETURN(c.perftest, value());
    } else {
      return makeError(ErrorCode::InvalidArgument, "unknown argument '" + a + "'");
    }
  }
  return c;
}

}  // namespace

int runBenchComm(const std::vector<std::string>& args) {
  if (!args.empty() && (args[0] == "--help" || args[0] == "-h")) {
    std::puts(kUsage);
    return 0;
  }
  auto cfg = parse(args);
  if (!cfg.ok()) {
    std::fprintf(stderr, "pdserve bench comm: %s\n%s\n", cfg.error().toString().c_str(), kUsage);
    return 2;
  }
  boost::json::array cases;
  if (!cfg->json) {
    std::printf("%-8s %-8s | %-28s | %-12s %-12s | %-10s %-10s\n", "floats", "bytes", "shm allreduce us (med/mean/p99)",
                "perftest sm", "perftest tcp", "ratio sm", "ratio tcp");
  }
  for (const std::int64_t n : cfg->floats) {
    auto ours = measureOurs(n, cfg->iterations, cfg->spin_us);
    if (!ours.ok()) {
      std::fprintf(stderr, "pdserve bench comm: %s\n", ours.error().toString().c_str());
      return 1;
    }
    boost::json::object o;
    o["floats"] = n;
    o["bytes"] = n * 4;
    o["shm_allreduce_median_us"] = ours->median_us;
    o["shm_allreduce_mean_us"] = ours->mean_us;
    o["shm_allreduce_p99_us"] = ours->p99_us;
    std::string cells[2] = {"n/a", "n/a"};
    std::string ratios[2] = {"n/a", "n/a"};
    const char* tls_names[2] = {"sm", "tcp"};
    for (int k = 0; k < 2; ++k) {
      auto lat = cfg->perftest.empty() ? Result<double>(makeError(ErrorCode::NotFound, "--perftest \"\""))
                                       : perftestLatency(cfg->perftest, tls_names[k], n * 4, cfg->iterations);
      const std::string key = fmt::format("ucx_perftest_am_lat_{}_us", tls_names[k]);
      if (lat.ok()) {
        o[key] = *lat;
        o[fmt::format("ratio_to_ucx_perftest_{}", tls_names[k])] = ours->median_us / *lat;
        cells[k] = fmt::format("{:.2f}", *lat);
        ratios[k] = fmt::format("{:.2f}", ours->median_us / *lat);
      } else {
        o[key] = nullptr;
        std::fprintf(stderr, "pdserve bench comm: ucx_perftest (UCX_TLS=%s): %s\n", tls_names[k],
                     lat.error().toString().c_str());
      }
    }
    if (!cfg->json) {
      std::printf("%-8lld %-8lld | %8.2f / %8.2f / %8.2f | %-12s %-12s | %-10s %-10s\n", static_cast<long long>(n),
                  static_cast<long long>(n * 4), ours->median_us, ours->mean_us, ours->p99_us, cells[0].c_str(),
                  cells[1].c_str(), ratios[0].c_str(), ratios[1].c_str());
    }
    cases.push_back(std::move(o));
  }
  if (cfg->json) {
    boost::json::object out;
    out["bench"] = "comm";
    out["ranks"] = 2;
    out["iterations"] = cfg->iterations;
    out["spin_us"] = cfg->spin_us;
    out["cases"] = std::move(cases);
    std::printf("%s\n", boost::json::serialize(out).c_str());
  } else {
    std::printf(
        "(2 processes; ours = ShmCommunicator::allReduceSum per call; perftest = ucp_am_lat one-way latency,\n"
        " median; ratio = ours / perftest)\n");
  }
  std::fflush(stdout);
  return 0;
}

}  // namespace pd::cli
