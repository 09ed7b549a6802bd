// pdserve bench comm: the tensor-parallel allreduce latency against ucx_perftest
// (tools/bench/comm).
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "bench/comm/comm_bench.h"
#include "bench/common/bench_util.h"
#include "cli.h"

namespace pd::cli {
namespace {

constexpr const char* kUsage =
    "usage: pdserve bench comm [--floats 7168,256] [--iterations 5000] [--spin-us 1000] [--json]\n"
    "                         [--perftest ucx_perftest]\n"
    "Measures the shared-memory communicator's allreduce of N floats between two processes (median\n"
    "per call) and ucx_perftest ucp_am_lat (one-way latency, median) for 4N bytes over UCX_TLS=sm\n"
    "and UCX_TLS=tcp; prints both and ours / perftest. 7168 = DeepSeek-V3's hidden size.";

// The whole of `text` as a decimal integer; -1 when it is not one (both counts that use it are >= 0).
long long wholeNumber(std::string_view text) {
  long long n = 0;
  const char* end = text.data() + text.size();
  // NOLINTNEXTLINE(bugprone-suspicious-stringview-data-usage): [data, end) is the whole view.
  const auto [ptr, ec] = std::from_chars(text.data(), end, n);
  return ec == std::errc() && ptr == end && !text.empty() ? n : -1;
}

Result<bench::CommBenchConfig> parse(const std::vector<std::string>& args, bool* json) {
  bench::CommBenchConfig c;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    const auto value = [&]() -> Result<std::string> {
      if (i + 1 >= args.size()) return makeError(ErrorCode::InvalidArgument, a + " needs a value");
      return args[++i];
    };
    if (a == "--json") {
      *json = true;
    } else if (a == "--floats") {
      PD_ASSIGN_OR_RETURN(std::string v, value());
      PD_ASSIGN_OR_RETURN(c.floats, bench::parsePositiveList(v, "--floats"));
      for (const std::int64_t n : c.floats) {
        if (n > (std::int64_t{1} << 26)) return makeError(ErrorCode::InvalidArgument, "--floats: bad count in " + v);
      }
    } else if (a == "--iterations") {
      PD_ASSIGN_OR_RETURN(std::string v, value());
      c.iterations = wholeNumber(v);
      if (c.iterations < 10) return makeError(ErrorCode::InvalidArgument, "--iterations must be >= 10");
    } else if (a == "--spin-us") {
      PD_ASSIGN_OR_RETURN(std::string v, value());
      c.spin_us = wholeNumber(v);
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
  bool json = false;
  auto cfg = parse(args, &json);
  if (!cfg.ok()) {
    std::fprintf(stderr, "pdserve bench comm: %s\n%s\n", cfg.error().toString().c_str(), kUsage);
    return 2;
  }
  auto rows = bench::runCommBench(*cfg);
  if (!rows.ok()) {
    std::fprintf(stderr, "pdserve bench comm: %s\n", rows.error().toString().c_str());
    return 1;
  }
  const std::string report = json ? bench::commReportJson(*cfg, *rows) + "\n" : bench::commReportText(*rows);
  std::fputs(report.c_str(), stdout);
  std::fflush(stdout);
  return 0;
}

}  // namespace pd::cli
