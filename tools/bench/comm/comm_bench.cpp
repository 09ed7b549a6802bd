// The tensor-parallel allreduce latency benchmark (comm_bench.h).
#include "bench/comm/comm_bench.h"

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
#include "pd/comm/shm_communicator.h"
#include "pd/common/log.h"

namespace pd::bench {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

// Rank 1 runs in a forked child (forked before any thread exists); rank 0 times each call.
Result<LatencySummary> measureOurs(std::int64_t floats, std::int64_t iterations, std::int64_t spin_us) {
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
  for (std::int64_t i = 0; i < warmup + iterations; ++i) {
    const auto t0 = Clock::now();
    if (Status s = (*c)->allReduceSum(v); !s.ok()) {
      ::waitpid(child, nullptr, 0);
      return std::move(s).error();
    }
    const double d = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
    if (i >= warmup) us.push_back(d);
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return makeError(ErrorCode::PeerFailed, "rank 1 failed");
  return summarizeLatencies(std::move(us));
}

// ucx_perftest ucp_am_lat between two local processes: the median one-way latency in us.
Result<double> perftestLatency(const std::string& perftest, const std::string& tls, std::int64_t bytes,
                               std::int64_t iterations) {
  PD_ASSIGN_OR_RETURN(const std::string text, runPerftestPair(perftest,
                                                              {"-t", "ucp_am_lat", "-s", std::to_string(bytes), "-n",
                                                               std::to_string(iterations), "-w", "500", "-v"},
                                                              {{"TLS", tls}}));
  if (auto lat = parsePerftestLatency(text)) return *lat;
  return makeError(ErrorCode::Internal, "could not parse ucx_perftest output: " + text);
}

}  // namespace

LatencySummary summarizeLatencies(std::vector<double> us) {
  LatencySummary r;
  if (us.empty()) return r;
  std::sort(us.begin(), us.end());
  double total = 0;
  for (const double v : us) total += v;
  r.median_us = us[us.size() / 2];
  r.mean_us = total / static_cast<double>(us.size());
  r.p99_us = us[us.size() * 99 / 100];
  return r;
}

std::optional<double> parsePerftestLatency(std::string_view text) {
  const std::vector<std::string> cols = lastCsvRow(text);  // iterations,50.0_percentile_lat,...
  if (cols.size() < 2) return std::nullopt;
  const double lat = std::strtod(cols[1].c_str(), nullptr);
  if (!(lat > 0)) return std::nullopt;
  return lat;
}

std::optional<double> ratioToCeiling(const LatencySummary& ours, const std::optional<double>& ceiling) {
  if (!ceiling || !(*ceiling > 0)) return std::nullopt;
  return ours.median_us / *ceiling;
}

Result<std::vector<CommRow>> runCommBench(const CommBenchConfig& cfg) {
  std::vector<CommRow> rows;
  for (const std::int64_t n : cfg.floats) {
    CommRow row;
    row.floats = n;
    PD_ASSIGN_OR_RETURN(row.ours, measureOurs(n, cfg.iterations, cfg.spin_us));
    for (const char* tls : {"sm", "tcp"}) {
      auto lat = cfg.perftest.empty() ? Result<double>(makeError(ErrorCode::NotFound, "--perftest \"\""))
                                      : perftestLatency(cfg.perftest, tls, n * 4, cfg.iterations);
      if (!lat.ok()) {
        log::warn("bench", "ucx_perftest (UCX_TLS={}): {}", tls, lat.error().toString());
        continue;
      }
      (std::string_view(tls) == "sm" ? row.perftest_sm_us : row.perftest_tcp_us) = *lat;
    }
    rows.push_back(row);
  }
  return rows;
}

std::string commReportText(const std::vector<CommRow>& rows) {
  const auto cell = [](const std::optional<double>& v) { return v ? fmt::format("{:.2f}", *v) : std::string("n/a"); };
  std::string out =
      fmt::format("{:<8} {:<8} | {:<28} | {:<12} {:<12} | {:<10} {:<10}\n", "floats", "bytes",
                  "shm allreduce us (med/mean/p99)", "perftest sm", "perftest tcp", "ratio sm", "ratio tcp");
  for (const CommRow& r : rows) {
    out += fmt::format("{:<8} {:<8} | {:8.2f} / {:8.2f} / {:8.2f} | {:<12} {:<12} | {:<10} {:<10}\n", r.floats,
                       r.floats * 4, r.ours.median_us, r.ours.mean_us, r.ours.p99_us, cell(r.perftest_sm_us),
                       cell(r.perftest_tcp_us), cell(ratioToCeiling(r.ours, r.perftest_sm_us)),
                       cell(ratioToCeiling(r.ours, r.perftest_tcp_us)));
  }
  out +=
      "(2 processes; ours = ShmCommunicator::allReduceSum per call; perftest = ucp_am_lat one-way latency,\n"
      " median; ratio = ours / perftest)\n";
  return out;
}

std::string commReportJson(const CommBenchConfig& cfg, const std::vector<CommRow>& rows) {
  boost::json::array cases;
  for (const CommRow& r : rows) {
    boost::json::object o;
    o["floats"] = r.floats;
    o["bytes"] = r.floats * 4;
    o["shm_allreduce_median_us"] = r.ours.median_us;
    o["shm_allreduce_mean_us"] = r.ours.mean_us;
    o["shm_allreduce_p99_us"] = r.ours.p99_us;
    for (const auto& [tls, lat] : {std::pair{"sm", r.perftest_sm_us}, std::pair{"tcp", r.perftest_tcp_us}}) {
      const std::string key = fmt::format("ucx_perftest_am_lat_{}_us", tls);
      if (lat) {
        o[key] = *lat;
        o[fmt::format("ratio_to_ucx_perftest_{}", tls)] = *ratioToCeiling(r.ours, lat);
      } else {
        o[key] = nullptr;
      }
    }
    cases.push_back(std::move(o));
  }
  boost::json::object out;
  out["bench"] = "comm";
  out["ranks"] = 2;
  out["iterations"] = cfg.iterations;
  out["spin_us"] = cfg.spin_us;
  out["cases"] = std::move(cases);
  return boost::json::serialize(out);
}

}  // namespace pd::bench
