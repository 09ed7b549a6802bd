#pragma once
/// Helpers shared by the `pdserve bench` benchmarks that measure the CPU engine against
/// ceilings measured in the same run (bench engine, bench decode): timing, CPU time, the
/// read-bandwidth probe, and list options; and the one ucx_perftest runner of the benches that
/// compare with it (bench kv, bench comm).
/// Thread rules: main thread only (the probe runs on the given thread pool).

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "pd/common/result.h"
#include "pd/engine/kernels.h"
#include "pd/engine/thread_pool.h"

namespace pd::bench {

using BenchClock = std::chrono::steady_clock;

/// Seconds since `t`.
[[nodiscard]] double secondsSince(BenchClock::time_point t);

/// CPU seconds this process has used (all threads).
[[nodiscard]] double processCpuSeconds();

/// Best-of-5 read bandwidth of a streaming pass over `bytes` with every thread of `pool`, in
/// bytes/s (one read of each cache line, first-touched by the threads that read it).
[[nodiscard]] double measureReadBandwidth(model::ThreadPool& pool, const model::KernelTable& k, std::size_t bytes);

/// "1,4,16" -> {1, 4, 16}; every entry an integer >= 1. InvalidArgument whose message is the
/// first bad entry otherwise.
[[nodiscard]] Result<std::vector<std::int64_t>> positiveIntegers(std::string_view text);

/// positiveIntegers(text), or InvalidArgument naming `option` and the whole list.
[[nodiscard]] Result<std::vector<std::int64_t>> parsePositiveList(const std::string& text, const std::string& option);

/// Environment entries for a child, as UCX_<name>=<value> (e.g. {"TLS", "tcp,sm"}).
using UcxEnv = std::vector<std::pair<std::string, std::string>>;

/// Starts `argv` (PATH search) with stdout and stderr to `stdout_fd` and the environment plus
/// `ucx` (replacing UCX_<name> variables already set); nullopt when it cannot start.
[[nodiscard]] std::optional<pid_t> spawnWithUcxEnv(const std::vector<std::string>& argv, const UcxEnv& ucx,
                                                   int stdout_fd);

/// Waits for `pid` up to `timeout`; kills it after that. True when it exited with status 0.
bool reapWithin(pid_t pid, std::chrono::milliseconds timeout);

/// The one ucx_perftest runner: a server (`perftest -p PORT`) and a client (`perftest 127.0.0.1
/// -p PORT client_args...`) on a free loopback port, both with `ucx` in their environment; the
/// client's output. A failed client (most likely the server was not listening yet) is retried up
/// to 5 times. NotFound when `perftest` cannot be started; Internal when every attempt failed.
[[nodiscard]] Result<std::string> runPerftestPair(const std::string& perftest,
                                                  const std::vector<std::string>& client_args, const UcxEnv& ucx);

/// The comma-separated fields of the last non-empty line of ucx_perftest's -v output (its CSV
/// summary: iterations,50.0_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw,avg_mr,overall_mr).
[[nodiscard]] std::vector<std::string> lastCsvRow(std::string_view output);

}  // namespace pd::bench
